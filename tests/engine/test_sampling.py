"""Sampling against the definitions of top-k, top-p and temperature."""

import math

import pytest
import torch

from ridgefill_runtime.errors import InputError
from ridgefill_runtime.sampling import filter_logits, sample_token
from ridgefill_runtime.sequence import SamplingParams


def test_top_k_keeps_exactly_k_largest():
    logits = torch.tensor([0.1, 3.0, -1.0, 2.0, 5.0])
    kept = torch.isfinite(filter_logits(logits, top_k=2, top_p=1.0))
    assert kept.tolist() == [False, True, False, False, True]


def test_top_p_keeps_smallest_prefix_reaching_p():
    probs = torch.tensor([0.05, 0.5, 0.3, 0.15])
    logits = probs.log()
    for p, expect in [(0.5, {1}), (0.51, {1, 2}), (0.8, {1, 2}), (0.81, {1, 2, 3}), (1.0, {0, 1, 2, 3})]:
        kept = set(torch.nonzero(torch.isfinite(filter_logits(logits, 0, p))).flatten().tolist())
        assert kept == expect, p


@pytest.mark.parametrize("scale,rank", [(4.0, 40), (4.0, 700), (0.05, 3000)])
def test_top_p_over_a_large_vocabulary_matches_a_full_float64_sort(scale, rank):
    """Peaked logits: the nucleus lies in the top NUCLEUS_CANDIDATES; flat ones (scale 0.05): the
    candidates' mass falls short and the whole vocabulary is sorted. top_p sits midway between two
    cumulative masses of a float64 sort, so exactly the `rank + 2` most likely tokens must stay."""
    logits = torch.randn(5000, generator=torch.Generator().manual_seed(rank)) * scale
    probs = logits.double().softmax(-1)
    order = probs.argsort(descending=True)
    mass = probs[order].cumsum(-1)
    top_p = float(mass[rank] + mass[rank + 1]) / 2
    kept = torch.isfinite(filter_logits(logits, 0, top_p))
    assert set(torch.nonzero(kept).flatten().tolist()) == set(order[: rank + 2].tolist())


def test_greedy_is_argmax():
    logits = torch.randn(100, generator=torch.Generator().manual_seed(0))
    assert sample_token(logits, SamplingParams(temperature=0), None) == int(logits.argmax())


def test_seeded_sampling_is_reproducible_and_matches_distribution():
    logits = torch.tensor([1.0, 2.0, 0.5, 0.0])
    params = SamplingParams(temperature=0.7, seed=3)

    def draw():
        g = torch.Generator().manual_seed(3)
        return [sample_token(logits, params, g) for _ in range(50)]

    assert draw() == draw()
    g = torch.Generator().manual_seed(11)
    n = 20000
    counts = torch.bincount(torch.tensor([sample_token(logits, params, g) for _ in range(n)]), minlength=4)
    expect = torch.softmax(logits / 0.7, -1)
    # 5 standard errors of a binomial proportion
    tol = 5 * torch.sqrt(expect * (1 - expect) / n)
    assert torch.all((counts / n - expect).abs() < tol)


def test_top_k_minus_one_means_off():
    # vLLM and llama.cpp write "no top-k" as -1; other negatives stay refused (below).
    assert SamplingParams(top_k=-1).top_k == 0 == SamplingParams().top_k


@pytest.mark.parametrize(
    "kw",
    [
        dict(temperature=-1),
        dict(top_p=0),
        dict(top_p=1.5),
        dict(top_k=-2),
        dict(max_tokens=-1),
        dict(temperature=math.nan),
        dict(stop=("",)),
    ],
)
def test_invalid_params_raise_one_clear_error(kw):
    with pytest.raises(InputError) as e:
        SamplingParams(**kw)
    assert list(kw)[0] in str(e.value) or "stop" in str(e.value)


@pytest.mark.parametrize("top_p", [2.2250738585072014e-308, 5e-324, 1e-50])
def test_a_top_p_below_float32_keeps_the_most_likely_token(top_p):
    # The fuzz run's 500: a top_p that rounds to 0 in float32 dropped every token (NaN probs).
    logits = torch.tensor([0.5, 3.0, -1.0, 2.9])
    filtered = filter_logits(logits, 0, top_p)
    assert torch.isfinite(filtered).tolist() == [False, True, False, False]
    params = SamplingParams(temperature=1.0, top_p=top_p)
    assert sample_token(logits, params, torch.Generator().manual_seed(0)) == 1
