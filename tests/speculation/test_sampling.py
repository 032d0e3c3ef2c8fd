"""target_probs against a plain-Python reference; parameter validation; the sampler."""

from __future__ import annotations

import math

import pytest
import torch
from scipy.stats import chisquare

from workers.speculation import SamplingParams, make_generator, sample, target_probs
from workers.speculation.sampling import first_argmax, tempered, top_p_mask


def reference_probs(logits: list[float], params: SamplingParams) -> list[float]:
    """Temperature, min-p, top-k, top-p, renormalise: the textbook definition, one row."""
    v = len(logits)
    if params.temperature == 0:
        best = max(range(v), key=lambda i: (logits[i], -i))
        return [1.0 if i == best else 0.0 for i in range(v)]
    x = [value / params.temperature for value in logits]
    if params.min_p:
        weights = [math.exp(value - max(x)) for value in x]
        share = [w / max(weights) for w in weights]  # p / p_max
        x = [value if s >= params.min_p else -math.inf for value, s in zip(x, share, strict=True)]
    if params.top_k:
        kth = sorted(x, reverse=True)[min(params.top_k, v) - 1]
        x = [value if value >= kth else -math.inf for value in x]
    top = max(x)
    weights = [math.exp(value - top) for value in x]
    probs = [w / sum(weights) for w in weights]
    if params.top_p < 1:
        keep, mass = set(), 0.0
        for i in sorted(range(v), key=lambda i: -probs[i]):
            keep.add(i)
            mass += probs[i]
            if mass >= params.top_p:
                break
        probs = [p if i in keep else 0.0 for i, p in enumerate(probs)]
    total = sum(probs)
    return [p / total for p in probs]


PARAMS = [
    SamplingParams(),
    SamplingParams(temperature=1.0),
    SamplingParams(temperature=0.5),
    SamplingParams(temperature=2.0, top_k=3),
    SamplingParams(temperature=1.0, top_k=1),
    SamplingParams(temperature=1.0, top_k=50),  # larger than V: off
    SamplingParams(temperature=0.8, top_p=0.5),
    SamplingParams(temperature=1.3, top_p=0.9, top_k=6),
    SamplingParams(temperature=1.0, top_p=1e-6),  # keeps exactly the argmax
    SamplingParams(temperature=1.0, min_p=0.1),
    SamplingParams(temperature=0.7, min_p=0.3, top_k=5, top_p=0.8),
    SamplingParams(temperature=1.0, min_p=1.0),  # the likeliest (and its ties) only
    SamplingParams(min_p=0.5),  # greedy: min-p changes nothing
]


@pytest.mark.parametrize("params", PARAMS, ids=repr)
def test_target_probs_matches_reference(params: SamplingParams):
    gen = torch.Generator().manual_seed(3)
    logits = torch.randn(4, 6, 12, generator=gen) * 2  # (B, T, V)
    probs = target_probs(logits, params)
    assert probs.shape == logits.shape and probs.dtype == torch.float32
    for row, out in zip(logits.reshape(-1, 12), probs.reshape(-1, 12), strict=True):
        expected = torch.tensor(reference_probs(row.tolist(), params))
        torch.testing.assert_close(out, expected, atol=1e-6, rtol=1e-5)


def test_target_probs_masked_logits_and_ties():
    logits = torch.tensor([1.0, float("-inf"), 1.0, 0.0])
    assert target_probs(logits, SamplingParams()).tolist() == [1.0, 0.0, 0.0, 0.0]
    probs = target_probs(logits, SamplingParams(temperature=1.0, top_k=1))
    assert probs[1] == 0 and probs[3] == 0 and torch.isclose(probs[0], probs[2])  # ties kept


def test_target_probs_rejects_bad_logits():
    with pytest.raises(ValueError, match="floating-point"):
        target_probs(torch.tensor([1, 2]), SamplingParams())
    with pytest.raises(ValueError, match="NaN"):
        target_probs(torch.tensor([0.0, float("nan")]), SamplingParams(temperature=1.0))
    with pytest.raises(ValueError, match="no finite"):
        target_probs(torch.full((2, 3), float("-inf")), SamplingParams(temperature=1.0))


@pytest.mark.parametrize(
    "kwargs, field",
    [
        ({"temperature": -0.1}, "temperature"),
        ({"temperature": float("nan")}, "temperature"),
        ({"top_p": 0.0}, "top_p"),
        ({"top_p": 1.5}, "top_p"),
        ({"top_k": -1}, "top_k"),
        ({"top_k": 2.5}, "top_k"),
        ({"seed": "7"}, "seed"),
        ({"min_p": -0.1}, "min_p"),
        ({"min_p": 1.5}, "min_p"),
        ({"min_p": float("nan")}, "min_p"),
    ],
)
def test_sampling_params_validation(kwargs, field):
    with pytest.raises(ValueError, match=field):
        SamplingParams(**kwargs)


def test_greedy_property():
    assert SamplingParams().greedy
    assert not SamplingParams(temperature=0.7).greedy


def test_sample_follows_probs_and_skips_zeros():
    probs = torch.tensor([0.1, 0.0, 0.6, 0.3, 0.0])
    gen = make_generator(11)
    counts = torch.zeros(5)
    for _ in range(4000):
        counts[sample(probs, gen)] += 1
    assert counts[1] == 0 and counts[4] == 0
    keep = probs > 0
    assert chisquare(counts[keep].numpy(), (probs[keep] * 4000).numpy()).pvalue > 1e-3
    assert sample(torch.tensor([0.0, 0.0, 2.0]), gen) == 2  # unnormalised is fine


def test_sample_is_reproducible_per_seed():
    probs = torch.softmax(torch.arange(10.0), dim=0)
    a = [sample(probs, make_generator(5)) for _ in range(3)]
    g1, g2 = make_generator(5), make_generator(5)
    assert [sample(probs, g1) for _ in range(20)] == [sample(probs, g2) for _ in range(20)]
    assert len(set(a)) == 1
    make_generator(None)  # nondeterministic seed still gives a working generator


@pytest.mark.parametrize(
    "probs", [torch.zeros(3), torch.tensor([0.5, -0.1, 0.6]), torch.tensor([float("nan"), 1.0])]
)
def test_sample_rejects_bad_probs(probs):
    with pytest.raises(ValueError):
        sample(probs, make_generator(0))


def test_a_tiny_temperature_gives_the_argmax_not_nan():
    """What the draft and the target both divide by: 5e-324 rounds to 0 in float32."""
    logits = torch.tensor([[1.0, 3.0, 2.0], [0.5, -1.0, float("-inf")]])
    probs = torch.softmax(tempered(logits, 5e-324), dim=-1)
    assert torch.equal(probs, torch.tensor([[0.0, 1.0, 0.0], [1.0, 0.0, 0.0]]))


def test_first_argmax_is_torchs_argmax_ties_masks_and_nans_included():
    gen = torch.Generator().manual_seed(0)
    x = torch.randint(0, 5, (7, 300), generator=gen).float()  # many ties for the largest
    x[1, :150] = float("-inf")  # a masked half
    x[2, 10] = x[2, 40] = float("nan")  # NaN counts as the largest, the first one wins
    x[3] = float("-inf")
    x[3, 299] = 0.0
    for logits in (x, x[2:5], x.t().contiguous().t(), x[:, ::2], x[0], x.bfloat16()):
        assert torch.equal(first_argmax(logits), logits.argmax(dim=-1))
    assert first_argmax(x).dtype == torch.long


def top_p_by_full_sort(probs: torch.Tensor, top_p: float) -> torch.Tensor:
    """The rule by its definition: sort every token, keep those whose mass before is below."""
    sorted_p, order = probs.sort(dim=-1, descending=True, stable=True)
    keep_sorted = sorted_p.cumsum(dim=-1) - sorted_p < top_p
    keep_sorted[..., 0] = True
    return torch.zeros_like(keep_sorted).scatter_(-1, order, keep_sorted)


@pytest.mark.parametrize("vocab", [300, 5000, 49152])
def test_top_p_keeps_the_set_a_full_sort_keeps_bit_for_bit(vocab):
    gen = torch.Generator().manual_seed(vocab)
    logits = torch.randn(6, vocab, generator=gen)
    logits[0] *= 12  # peaked: a handful of tokens hold the mass
    logits[1] *= 0.2  # flat: thousands, past every candidate count
    logits[2] = (logits[2] * 2).round()  # ties everywhere, at the boundary too
    logits[3, vocab // 2 :] = float("-inf")  # a masked half
    logits[4] = logits[4] * 5 - 40 * (torch.arange(vocab) % 7 == 0)
    logits[5] = -20.0  # 100 tokens tied at the top, past the first candidate count: top_p
    logits[5, torch.randperm(vocab, generator=gen)[:100]] = 5.0  # cuts into them by id
    probs = torch.softmax(logits, dim=-1)
    for top_p in (1e-9, 0.3, 0.9, 0.95, 0.999999):
        expected = top_p_by_full_sort(probs, top_p)
        assert torch.equal(top_p_mask(probs, top_p), expected)
        assert torch.equal(top_p_mask(probs[2], top_p), expected[2])
        assert torch.equal(
            top_p_mask(probs.reshape(2, 3, vocab), top_p), expected.reshape(2, 3, -1)
        )
