"""Gated DeltaNet: chunked and recurrent references against a float64 loop and against transformers'
torch_chunk_gated_delta_rule / torch_recurrent_gated_delta_rule; chunk/step/state-only consistency;
states carried across calls equal one long scan."""

from __future__ import annotations

import math

import pytest
import torch
from transformers.models.qwen3_next.modeling_qwen3_next import (
    torch_chunk_gated_delta_rule,
    torch_recurrent_gated_delta_rule,
)

from ridgefill_runtime import ops
from ridgefill_runtime.ops import (
    gdn_chunk,
    gdn_chunk_reference,
    gdn_recurrent_reference,
    gdn_state_update,
    gdn_step,
)

UNIT_ROUNDOFF = {torch.float32: 0.0, torch.bfloat16: 2.0**-8, torch.float16: 2.0**-11}
DTYPES = list(UNIT_ROUNDOFF)


def make_inputs(
    batch, seq_len, k_heads, v_heads, k_dim, v_dim, dtype=torch.float32, device="cpu", seed=0, with_state=True
):
    gen = torch.Generator().manual_seed(seed)
    q = torch.randn(batch, seq_len, k_heads, k_dim, generator=gen)
    k = torch.randn(batch, seq_len, k_heads, k_dim, generator=gen)
    v = torch.randn(batch, seq_len, v_heads, v_dim, generator=gen)
    # Qwen3-Next: g = -exp(A_log) * softplus(a + dt_bias) <= 0; beta = sigmoid(b). Spread g so some
    # steps nearly forget (g ~ -5) and some barely decay.
    g = -torch.nn.functional.softplus(2 * torch.randn(batch, seq_len, v_heads, generator=gen))
    beta = torch.sigmoid(torch.randn(batch, seq_len, v_heads, generator=gen))
    state = torch.randn(batch, v_heads, k_dim, v_dim, generator=gen) * 0.5 if with_state else None
    cast = lambda t: None if t is None else t.to(device)  # noqa: E731
    return (cast(q.to(dtype)), cast(k.to(dtype)), cast(v.to(dtype)), cast(g), cast(beta.to(dtype)), cast(state))


def naive_f64(q, k, v, g, beta, state, use_qk_l2norm):
    """The convention written out per (sequence, value head, step) in float64."""
    batch, seq_len, k_heads, k_dim = k.shape
    v_heads, v_dim = v.shape[2:]
    ratio = v_heads // k_heads
    out = torch.zeros(batch, seq_len, v_heads, v_dim, dtype=torch.float64)
    final = torch.zeros(batch, v_heads, k_dim, v_dim, dtype=torch.float64)
    for b in range(batch):
        for h in range(v_heads):
            s = state[b, h].double().clone() if state is not None else torch.zeros(k_dim, v_dim, dtype=torch.float64)
            for t in range(seq_len):
                qt = q[b, t, h // ratio].double() if q is not None else None
                kt = k[b, t, h // ratio].double()
                if use_qk_l2norm:
                    kt = kt / math.sqrt(float(kt @ kt) + 1e-6)
                    if qt is not None:
                        qt = qt / math.sqrt(float(qt @ qt) + 1e-6)
                s = math.exp(float(g[b, t, h])) * s
                delta = float(beta[b, t, h]) * (v[b, t, h].double() - s.T @ kt)
                s = s + torch.outer(kt, delta)
                if qt is not None:
                    out[b, t, h] = s.T @ (qt / math.sqrt(k_dim))
            final[b, h] = s
    return out, final


SHAPES = [
    # (B, T, Hk, Hv, Dk, Dv)
    (1, 1, 1, 1, 4, 3),
    (2, 7, 2, 2, 8, 5),
    (1, 70, 1, 3, 6, 7),  # crosses a 64-token chunk; GQA 3
    (2, 13, 2, 4, 5, 9),  # odd dims, GQA 2
]


@pytest.mark.parametrize("use_qk_l2norm", [False, True])
@pytest.mark.parametrize("shape", SHAPES, ids=str)
@pytest.mark.parametrize("with_state", [True, False])
def test_references_match_naive_f64(shape, use_qk_l2norm, with_state):
    q, k, v, g, beta, state = make_inputs(*shape, seed=sum(shape), with_state=with_state)
    exp_out, exp_state = naive_f64(q, k, v, g, beta, state, use_qk_l2norm)
    for fn in (gdn_recurrent_reference, gdn_chunk_reference):
        out, final = fn(q, k, v, g, beta, state, use_qk_l2norm)
        assert out.dtype == torch.float32 and out.shape == exp_out.shape and final.shape == exp_state.shape
        torch.testing.assert_close(out.double(), exp_out, rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(final.double(), exp_state, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("chunk_size", [1, 3, 16, 64])
def test_chunk_sizes_agree(chunk_size):
    q, k, v, g, beta, state = make_inputs(2, 37, 2, 4, 8, 6, seed=chunk_size)
    out, final = gdn_chunk_reference(q, k, v, g, beta, state, True, chunk_size=chunk_size)
    rec_out, rec_final = gdn_recurrent_reference(q, k, v, g, beta, state, True)
    torch.testing.assert_close(out, rec_out, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(final, rec_final, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("use_qk_l2norm", [False, True])
def test_matches_transformers(dtype, use_qk_l2norm):
    q, k, v, g, beta, state = make_inputs(2, 70, 2, 4, 16, 8, dtype=dtype, seed=4)
    ours_chunk = gdn_chunk_reference(q, k, v, g, beta, state, use_qk_l2norm)
    ours_rec = gdn_recurrent_reference(q, k, v, g, beta, state, use_qk_l2norm)
    hf_chunk = torch_chunk_gated_delta_rule(
        q, k, v, g, beta, initial_state=state, output_final_state=True, use_qk_l2norm_in_kernel=use_qk_l2norm
    )
    hf_rec = torch_recurrent_gated_delta_rule(
        q, k, v, g, beta, initial_state=state, output_final_state=True, use_qk_l2norm_in_kernel=use_qk_l2norm
    )
    # Same fp32 math up to summation order (noise relative to the largest magnitude, which grows
    # without the L2 norm); outputs then round once to dtype (allow one ulp).
    u = UNIT_ROUNDOFF[dtype]
    for ours, hf in ((ours_chunk, hf_chunk), (ours_rec, hf_rec), (ours_chunk, hf_rec)):
        assert ours[0].dtype == hf[0].dtype == dtype
        out_noise = 1e-5 * float(hf[0].float().abs().max())
        state_noise = 1e-5 * float(hf[1].abs().max())
        torch.testing.assert_close(ours[0].float(), hf[0].float(), rtol=2 * u + 1e-5, atol=out_noise)
        torch.testing.assert_close(ours[1], hf[1].float(), rtol=1e-5, atol=state_noise)


def test_scale_convention_is_distinguishable():
    # Teeth for the transformers comparison: forgetting the 1/sqrt(d_k) (or applying it to k)
    # changes outputs far beyond the tolerance above.
    q, k, v, g, beta, state = make_inputs(1, 9, 1, 1, 16, 4, seed=5)
    out, _ = gdn_recurrent_reference(q, k, v, g, beta, state, True)
    unscaled, _ = gdn_recurrent_reference(q * 4.0, k, v, g, beta, state, True)  # l2norm cancels the 4
    torch.testing.assert_close(out, unscaled, rtol=1e-5, atol=1e-6)
    plain, _ = gdn_recurrent_reference(q, k, v, g, beta, state, False)
    assert (plain - out).abs().max() > 1e-2


def test_states_carried_across_calls_equal_one_scan():
    q, k, v, g, beta, state = make_inputs(2, 50, 1, 2, 8, 8, seed=6)
    full_out, full_state = gdn_chunk(q, k, v, g, beta, state, True)
    outs, s = [], state
    for lo, hi in ((0, 1), (1, 18), (18, 18), (18, 50)):  # includes an empty piece
        o, s = gdn_chunk(q[:, lo:hi], k[:, lo:hi], v[:, lo:hi], g[:, lo:hi], beta[:, lo:hi], s, True)
        outs.append(o)
    torch.testing.assert_close(torch.cat(outs, 1), full_out, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(s, full_state, rtol=1e-5, atol=1e-5)
    # Decode steps from the same start.
    s = state
    for t in range(50):
        o, s = gdn_step(q[:, t], k[:, t], v[:, t], g[:, t], beta[:, t], s, True)
        assert o.shape == (2, 2, 8)
        torch.testing.assert_close(o, full_out[:, t], rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(s, full_state, rtol=1e-5, atol=1e-5)
    # Filled rows: the state-only op carries the same state without q.
    s = gdn_state_update(k[:, :30], v[:, :30], g[:, :30], beta[:, :30], state, True)
    s = gdn_state_update(k[:, 30:], v[:, 30:], g[:, 30:], beta[:, 30:], s, True)
    torch.testing.assert_close(s, full_state, rtol=1e-5, atol=1e-5)


def test_empty_sequence_passes_state_through():
    q, k, v, g, beta, state = make_inputs(2, 0, 1, 2, 4, 4, seed=7)
    out, final = gdn_chunk(q, k, v, g, beta, state)
    assert out.shape == (2, 0, 2, 4) and torch.equal(final, state)
    out, final = gdn_chunk(q, k, v, g, beta, None)
    assert torch.equal(final, torch.zeros_like(state))


def test_rejects_bad_arguments():
    q, k, v, g, beta, state = make_inputs(1, 3, 2, 3, 4, 4, seed=8)
    with pytest.raises(ValueError, match="multiple of Hk"):
        gdn_chunk(q, k, v, g, beta, None)
    q, k, v, g, beta, state = make_inputs(1, 3, 1, 2, 4, 4, seed=8)
    with pytest.raises(ValueError, match="state must be float32"):
        gdn_chunk(q, k, v, g, beta, state.double())
    with pytest.raises(ValueError, match="g must be"):
        gdn_chunk(q, k, v, g[:, :2], beta, state)


# ---------------------------------------------------------------------------
# CUDA kernel (a fused sequential scan for all three ops).


def _poison(*shapes_dtypes):
    for shape, dtype in shapes_dtypes:
        torch.full(shape, float("nan"), dtype=dtype, device="cuda")


GPU_SHAPES = SHAPES + [(2, 200, 4, 8, 128, 128), (1, 33, 2, 4, 256, 96), (3, 17, 1, 1, 64, 200)]


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("shape", GPU_SHAPES, ids=str)
@pytest.mark.parametrize("use_qk_l2norm", [False, True])
def test_kernel_chunk_matches_reference(shape, dtype, use_qk_l2norm):
    assert ops.extension_loaded(), ops.extension_error()
    batch, seq_len, k_heads, v_heads, k_dim, v_dim = shape
    for seed in range(2):
        q, k, v, g, beta, state = make_inputs(*shape, dtype=dtype, device="cuda", seed=seed)
        _poison(((batch, seq_len, v_heads, v_dim), dtype), ((batch, v_heads, k_dim, v_dim), torch.float32))
        out, final = torch.ops.ridgefill.gdn_chunk(q, k, v, g, beta, state, use_qk_l2norm)
        # Exact: fp32 recurrent reference on the (already rounded) inputs, final rounding skipped.
        exact_out, exact_state = gdn_recurrent_reference(
            q.float(), k.float(), v.float(), g, beta.float(), state, use_qk_l2norm
        )
        assert out.dtype == dtype and final.dtype == torch.float32 and not out.isnan().any()
        # The kernel's fp32 math differs from the reference only in summation order: the state
        # matches to fp32 noise for every dtype; the output carries one rounding to dtype.
        torch.testing.assert_close(final, exact_state, rtol=1e-4, atol=1e-4)
        tol = UNIT_ROUNDOFF[dtype]
        torch.testing.assert_close(out.float(), exact_out, rtol=2 * tol + 1e-4, atol=1e-4)
        state_only = torch.ops.ridgefill.gdn_state_update(k, v, g, beta, state, use_qk_l2norm)
        torch.testing.assert_close(state_only, final, rtol=1e-6, atol=1e-6)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_kernel_step_chain_equals_chunk(dtype):
    q, k, v, g, beta, state = make_inputs(2, 20, 2, 4, 128, 128, dtype=dtype, device="cuda", seed=3)
    out, final = torch.ops.ridgefill.gdn_chunk(q, k, v, g, beta, state, True)
    s = state
    for t in range(20):
        _poison(((2, 4, 128), dtype))
        o, s = torch.ops.ridgefill.gdn_step(q[:, t], k[:, t], v[:, t], g[:, t], beta[:, t], s, True)
        torch.testing.assert_close(o, out[:, t], rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(s, final, rtol=1e-5, atol=1e-5)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_kernel_opcheck(dtype):
    q, k, v, g, beta, state = make_inputs(2, 9, 1, 2, 32, 16, dtype=dtype, device="cuda", seed=9)
    torch.library.opcheck(torch.ops.ridgefill.gdn_chunk.default, (q, k, v, g, beta, state, True))
    torch.library.opcheck(torch.ops.ridgefill.gdn_chunk.default, (q, k, v, g, beta, None, False))
    torch.library.opcheck(torch.ops.ridgefill.gdn_state_update.default, (k, v, g, beta, state, True))
    torch.library.opcheck(
        torch.ops.ridgefill.gdn_step.default, (q[:, 0], k[:, 0], v[:, 0], g[:, 0], beta[:, 0], state, False)
    )
