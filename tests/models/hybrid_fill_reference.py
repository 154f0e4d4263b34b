"""The hybrids' two-sweep prefill, written with transformers' own decoder layers (independent of
our model code): layers below the split run exactly over every row; from the split on, each
layer runs over every row with the filled rows' input replaced by x̂_l = predict(l, x_S), and
only the other rows keep its output. So at an attention layer the filled rows' K/V come from
x̂_l and the exact rows' from their true input; at a Gated DeltaNet layer the state is carried
over all rows in order, from x̂_l on filled rows. Its cache then decodes as transformers does."""

from __future__ import annotations

import torch
from transformers import DynamicCache


@torch.no_grad()
def reference_two_sweep(
    ref,
    ids: list[int],
    split: int,
    filled: torch.Tensor,
    predict,
    shifts=None,
    boundary: int | None = None,
    rescale_rows: int | None = None,
):
    """-> (logits [n, V] (rows of filled positions meaningless), the transformers cache).
    filled: [n] bool; predict(layer, x_split [F, d]) -> x̂ [F, d]. With `boundary`, the late
    layers run the prefix (rows before it), then the tail, and between the two: with shifts
    ({GDN layer: ΔM}) each GDN state gets ρ·ΔM, ρ from a float64 loop over the layer's gates;
    with rescale_rows c, each attention layer's filled values are scaled per KV head by the mean
    exact / predicted value-norm ratio of the first c tail rows."""
    body = ref.model
    n = len(ids)
    pos = torch.arange(n)[None]
    cache = DynamicCache(config=ref.config)
    h = body.embed_tokens(torch.tensor([ids]))  # [1, n, d]
    rope = body.rotary_emb(h, pos)
    for layer in body.layers[:split]:
        h = layer(h, position_embeddings=rope, attention_mask=None, position_ids=pos, cache=cache)
    x_split = h[0].clone()  # [n, d]
    hidden = x_split.clone()
    boundary = n if boundary is None else boundary
    for i, layer in enumerate(body.layers[split:], start=split):
        inputs = hidden.clone()
        inputs[filled] = predict(i, x_split[filled])
        out = _run(layer, inputs, rope, pos, cache, 0, boundary)
        if shifts is not None and layer.block_type == "linear_attention":
            rho = gate_share(layer_gates(layer, inputs[:boundary]), filled[:boundary])  # [Hv] float64
            state = cache.get_recurrent_state(i)  # [1, Hv, Dk, Dv]
            state += (rho[:, None, None] * shifts[i].double()).to(state.dtype)
        if rescale_rows and layer.block_type != "linear_attention":
            _rescale_values(layer, cache.layers[i].values, inputs, x_split, predict, i, filled, boundary, rescale_rows)
        if boundary < n:
            out = torch.cat([out, _run(layer, inputs, rope, pos, cache, boundary, n)])
        hidden[~filled] = out[~filled]
    return ref.lm_head(body.norm(hidden)).float(), cache


def _rescale_values(layer, values, inputs, x_split, predict, i, filled, boundary, c) -> None:
    """values [1, Hkv, n, D] of the cache: filled positions times mean_c ||v_exact|| / ||v_pred||."""
    attn = layer.self_attn
    rows = slice(boundary, boundary + c)
    heads = attn.config.num_key_value_heads

    def v_of(x):
        return attn.v_proj(layer.input_layernorm(x)).view(x.shape[0], heads, -1)  # [c, Hkv, D]

    ratio = (v_of(inputs[rows]).norm(dim=-1) / v_of(predict(i, x_split[rows])).norm(dim=-1)).mean(0)  # [Hkv]
    values[0][:, filled[: values.shape[2]]] *= ratio[:, None, None]


def _run(layer, inputs, rope, pos, cache, lo: int, hi: int) -> torch.Tensor:
    """transformers' layer over rows [lo, hi) of inputs [n, d], after rows [0, lo) are cached."""
    mask = None  # NOTE: a GDN layer reads attention_mask as a 2-D padding mask; it needs none
    if lo > 0 and layer.block_type != "linear_attention":  # queries lo..hi-1 over keys 0..hi-1, causal
        mask = (torch.arange(hi)[None, :] <= torch.arange(lo, hi)[:, None])[None, None]
    part_rope = tuple(t[:, lo:hi] for t in rope)
    return layer(
        inputs[None, lo:hi], position_embeddings=part_rope, attention_mask=mask, position_ids=pos[:, lo:hi], cache=cache
    )[0]


def layer_gates(layer, inputs: torch.Tensor) -> torch.Tensor:
    """log-gates g [n, Hv] of a transformers GDN decoder layer on inputs [n, d], from its own
    projections: g = -exp(A_log) * softplus(a + dt_bias)."""
    gdn, x = layer.linear_attn, layer.input_layernorm(inputs[None])
    if hasattr(gdn, "in_proj_a"):
        a = gdn.in_proj_a(x)
    else:
        a = gdn.fix_query_key_value_ordering(gdn.in_proj_qkvz(x), gdn.in_proj_ba(x))[5]
    return (-gdn.A_log.float().exp() * torch.nn.functional.softplus(a.float() + gdn.dt_bias))[0]


def gate_share(g: torch.Tensor, filled: torch.Tensor) -> torch.Tensor:
    """Appendix H's ρ by its definition, a float64 loop: w_j = Π_{k=j+1..n-1} exp(g_k);
    ρ = Σ_filled w_j / Σ_j w_j, per head -> [Hv]."""
    n, heads = g.shape
    rho = torch.zeros(heads, dtype=torch.float64)
    for head in range(heads):
        total = part = 0.0
        for j in range(n):
            w = 1.0
            for k in range(j + 1, n):
                w *= float(torch.exp(g[k, head].double()))
            total += w
            part += w if bool(filled[j]) else 0.0
        rho[head] = part / total
    return rho


@torch.no_grad()
def reference_decode(ref, cache, first_token: int, start: int, steps: int) -> list[int]:
    """Greedy tokens after `first_token` at position `start`, decoding over the reference cache."""
    out, token = [], first_token
    for t in range(steps):
        logits = ref(
            input_ids=torch.tensor([[token]]), position_ids=torch.tensor([[start + t]]), cache=cache, use_cache=True
        ).logits[0, -1]
        token = int(logits.argmax())
        out.append(token)
    return out
