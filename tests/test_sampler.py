"""The sampler against references written the plain way: the filtered distribution against a full
sort of the vocabulary, draws against their probabilities, logprobs against a row's log-softmax."""
import pytest
import torch

import eecore
from eecore.engine import sampler as sampler_module
from eecore.engine.sampler import Sampler, draw_rows, invert_cdf, logprobs_rows


def reference_probabilities(logits: torch.Tensor, params: list[eecore.SamplingParams]) -> torch.Tensor:
    """Temperature, top-k, then top-p (the smallest most-likely prefix whose mass reaches top_p, over
    the top-k distribution), by sorting the whole vocabulary of every row."""
    out = []
    for row, p in zip(logits.float(), params):
        scaled = row / p.temperature
        values, order = scaled.sort(descending=True)
        k = p.top_k if 0 < p.top_k < row.numel() else row.numel()
        values[k:] = float("-inf")
        probs = torch.softmax(values, dim=-1)
        mass_before = probs.cumsum(dim=-1) - probs
        drop = mass_before >= p.top_p
        drop[0] = False
        values[drop] = float("-inf")
        out.append(torch.empty_like(row).scatter_(0, order, torch.softmax(values, dim=-1)))
    return torch.stack(out)


PARAMS = [
    dict(temperature=1.0),
    dict(temperature=0.7, top_k=5),
    dict(temperature=1.3, top_p=0.8),
    dict(temperature=0.9, top_k=40, top_p=0.6),
    dict(temperature=1.0, top_k=10_000),  # past the vocabulary: keeps it all
    dict(temperature=2.0, top_p=0.999),  # a flat row: its nucleus outgrows the first candidates
]


@pytest.mark.parametrize("vocab", [3, 100, 5000])
def test_probabilities_match_a_full_sort(vocab):
    g = torch.Generator().manual_seed(vocab)
    params = [eecore.SamplingParams(**kw) for kw in PARAMS]
    logits = torch.randn(len(params), vocab, generator=g) * 2
    got = Sampler.probabilities(logits, params)
    want = reference_probabilities(logits, params)
    assert got.shape == want.shape and got.dtype == torch.float32
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-7)
    assert torch.equal(got > 0, want > 0)  # the same tokens kept


def test_a_batch_mixing_filters_gives_each_row_its_own_distribution():
    g = torch.Generator().manual_seed(1)
    params = [eecore.SamplingParams(**PARAMS[i % len(PARAMS)]) for i in range(17)]
    logits = torch.randn(17, 2000, generator=g)
    torch.testing.assert_close(Sampler.probabilities(logits, params), reference_probabilities(logits, params),
                               rtol=1e-5, atol=1e-7)
    for i in (0, 5, 16):  # a row alone gets what it got in the batch
        torch.testing.assert_close(Sampler.probabilities(logits[i: i + 1], params[i: i + 1])[0],
                                   Sampler.probabilities(logits, params)[i])


def test_the_nucleus_search_widens_until_it_holds_top_p(monkeypatch):
    monkeypatch.setattr(sampler_module, "FIRST_NUCLEUS_CANDIDATES", 2)
    monkeypatch.setattr(sampler_module, "NUCLEUS_GROWTH", 2)
    logits = torch.zeros(1, 64)  # uniform: 0.9 of the mass needs 58 tokens
    got = Sampler.probabilities(logits, [eecore.SamplingParams(temperature=1.0, top_p=0.9)])
    assert int((got > 0).sum()) == 58
    torch.testing.assert_close(got.sum(), torch.tensor(1.0))


def test_draws_follow_the_probabilities():
    probs = torch.tensor([0.4, 0.0, 0.25, 0.2, 0.1, 0.05, 0.0])
    logits = probs.log().expand(40_000, -1)
    u = torch.rand(40_000, generator=torch.Generator().manual_seed(0))
    tokens = draw_rows(logits, [eecore.SamplingParams(temperature=1.0)] * 40_000, u)
    freq = torch.bincount(tokens, minlength=7).float() / 40_000
    assert freq[1] == 0 and freq[6] == 0
    # 40,000 draws: a standard deviation of at most 0.0025 per token
    assert (freq - probs).abs().max() < 0.01, freq


def test_top_k_and_top_p_draws_stay_in_the_kept_set():
    g = torch.Generator().manual_seed(3)
    params = [eecore.SamplingParams(temperature=1.0, top_k=3), eecore.SamplingParams(temperature=1.0, top_p=0.5)]
    logits = torch.randn(2, 50, generator=g)
    kept = reference_probabilities(logits, params) > 0
    for u in (0.0, 0.3, 0.999, 1.0 - 2 ** -24):
        tokens = draw_rows(logits, params, torch.full((2,), u))
        assert all(kept[i, t] for i, t in enumerate(tokens.tolist()))


def test_the_last_uniform_never_reaches_a_zero_weight():
    weights = torch.tensor([[0.0, 0.3, 0.7, 0.0, 0.0], [1.0, 0.0, 0.0, 0.0, 0.0]])
    assert invert_cdf(weights, torch.tensor([1.0 - 2 ** -24, 1.0 - 2 ** -24])).tolist() == [2, 0]
    assert invert_cdf(weights, torch.tensor([0.0, 0.0])).tolist() == [1, 0]


class _Seq:
    def __init__(self, seq_id, params):
        self.seq_id, self.params = seq_id, params


def test_a_seeded_row_draws_the_same_whatever_shares_its_batch():
    g = torch.Generator().manual_seed(5)
    logits = torch.randn(4, 300, generator=g)
    seeded = eecore.SamplingParams(temperature=1.0, top_p=0.9, seed=7)
    alone = Sampler(torch.device("cpu")).sample(logits[2:3], [_Seq(0, seeded)])[0]
    together = Sampler(torch.device("cpu")).sample(
        logits, [_Seq(1, eecore.SamplingParams(temperature=1.0)), _Seq(2, eecore.SamplingParams(temperature=0.0)),
                 _Seq(0, seeded), _Seq(3, eecore.SamplingParams(temperature=0.5, seed=8))])[0]
    assert together[2] == alone[0]
    assert together[1] == int(logits[1].argmax())


def test_logprobs_are_each_rows_log_softmax():
    g = torch.Generator().manual_seed(9)
    logits = torch.randn(3, 40, generator=g)
    tokens, ks = [5, 0, 39], [0, 3, 40]
    got = logprobs_rows(logits, tokens, ks)
    for row, token, k, d in zip(logits, tokens, ks, got):
        lp = torch.log_softmax(row, dim=-1)
        values, ids = lp.topk(k)
        want = dict(zip(ids.tolist(), values.tolist()))
        want[token] = float(lp[token])
        assert d == want
    assert Sampler.logprobs(logits[1], 0, 3) == got[1]
