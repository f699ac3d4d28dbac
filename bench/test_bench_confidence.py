"""The early-exit confidence ops against the torch compositions they replace.

    PYTHONPATH=python python -m pytest bench/test_bench_confidence.py --benchmark-enable -q

Each op shares a pytest-benchmark group with its baseline, so the table shows them side by side.
Decode sizes: B = 8 rows (and B = 1 for the top-2 ops); vocabularies of SmolLM2 (49152, d = 576)
and Llama 3 (128256, d = 2048). The baselines are what a careful PyTorch user would write:
  softmax_top2_gap   softmax(logits, dtype=fp32).topk(2): gap and top1
  lm_head_top2_gap   logits = hidden @ weight.T (in the model dtype), then the same
  hidden_cosine      F.cosine_similarity of the fp32 rows (and of the bf16 rows, as given)
  mlp_confidence     sigmoid(linear(relu(linear(h, w1, b1)), w2, b2))
  accept_update      status |= (confidence > threshold) & active; (active & ~status).sum()
These machines are shared and noisy: only ratios measured side by side in one run mean anything.
On a loaded machine every multi-threaded call (eecore's and torch's alike) can stall for a
scheduler tick waiting on a descheduled worker; EECORE_BENCH_THREADS=1 gives steadier figures.
"""
import os

import pytest
import torch
import torch.nn.functional as F

from eecore import ops

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}

if os.environ.get("EECORE_BENCH_THREADS"):
    torch.set_num_threads(int(os.environ["EECORE_BENCH_THREADS"]))


def softmax_topk_gap(logits):
    top = torch.softmax(logits, dim=-1, dtype=torch.float32).topk(2, dim=-1)
    return top.values[:, 0] - top.values[:, 1], top.indices[:, 0]


def _check_top2(got, want):
    torch.testing.assert_close(got[0], want[0], rtol=1e-3, atol=1e-6)


# ---------------------------------------------------------------------------------------------
# softmax_top2_gap
# ---------------------------------------------------------------------------------------------

@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("batch, vocab", [(8, 49152), (8, 128256), (1, 128256)])
@pytest.mark.parametrize("impl", ["eecore", "softmax+topk"])
def test_softmax_top2_gap(benchmark, impl, batch, vocab, dtype):
    benchmark.group = f"softmax_top2_gap B={batch} V={vocab} {dtype}"
    logits = (torch.randn(batch, vocab) * 4).to(DTYPES[dtype])
    fn = {"eecore": lambda: ops.softmax_top2_gap(logits), "softmax+topk": lambda: softmax_topk_gap(logits)}[impl]
    _check_top2(fn(), softmax_topk_gap(logits))
    benchmark(fn)


# ---------------------------------------------------------------------------------------------
# lm_head_top2_gap: the weights are big (1 GiB at V = 128256, d = 2048 in fp32), so one set is
# kept at a time and shared by the op and its baseline.
# ---------------------------------------------------------------------------------------------

_lm_head_inputs = {}


def lm_head_inputs(batch, d, vocab, dtype):
    key = (batch, d, vocab, dtype)
    if key not in _lm_head_inputs:
        _lm_head_inputs.clear()
        g = torch.Generator().manual_seed(0)
        hidden = (torch.randn(batch, d, generator=g) * 3 / d**0.5).to(dtype)
        _lm_head_inputs[key] = hidden, torch.randn(vocab, d, generator=g).to(dtype)
    return _lm_head_inputs[key]


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("batch, d, vocab", [(8, 576, 49152), (1, 576, 49152), (8, 2048, 128256), (1, 2048, 128256)])
@pytest.mark.parametrize("impl", ["eecore", "matmul+softmax+topk"])
def test_lm_head_top2_gap(benchmark, impl, batch, d, vocab, dtype):
    benchmark.group = f"lm_head_top2_gap B={batch} d={d} V={vocab} {dtype}"
    hidden, weight = lm_head_inputs(batch, d, vocab, DTYPES[dtype])
    fn = {"eecore": lambda: ops.lm_head_top2_gap(hidden, weight),
          "matmul+softmax+topk": lambda: softmax_topk_gap(hidden @ weight.T)}[impl]
    result = fn()
    if impl == "eecore":
        _check_top2(result, softmax_topk_gap(hidden.float() @ weight.float().T))
    # Seconds per call at the big shapes: a few rounds are plenty.
    benchmark.pedantic(fn, rounds=5 if vocab * d > 50_000_000 else 20, warmup_rounds=1)


# ---------------------------------------------------------------------------------------------
# hidden_cosine, mlp_confidence, accept_update
# ---------------------------------------------------------------------------------------------

@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("d", [576, 2048])
@pytest.mark.parametrize("impl", ["eecore", "F.cosine_similarity(fp32)", "F.cosine_similarity"])
def test_hidden_cosine(benchmark, impl, d, dtype):
    if impl == "F.cosine_similarity" and dtype == "fp32":
        pytest.skip("the same as the fp32 baseline")
    benchmark.group = f"hidden_cosine B=8 d={d} {dtype}"
    prev = torch.randn(8, d).to(DTYPES[dtype])
    cur = torch.randn(8, d).to(DTYPES[dtype])
    fn = {"eecore": lambda: ops.hidden_cosine(prev, cur),
          "F.cosine_similarity(fp32)": lambda: F.cosine_similarity(prev.float(), cur.float(), dim=-1, eps=1e-8),
          "F.cosine_similarity": lambda: F.cosine_similarity(prev, cur, dim=-1, eps=1e-8)}[impl]
    benchmark(fn)


def torch_mlp_confidence(hidden, w1, b1, w2, b2):
    return torch.sigmoid(F.linear(torch.relu(F.linear(hidden, w1, b1)), w2[None], b2)).squeeze(-1)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("d, m", [(576, 128), (2048, 512)])
@pytest.mark.parametrize("impl", ["eecore", "torch"])
def test_mlp_confidence(benchmark, impl, d, m, dtype):
    benchmark.group = f"mlp_confidence B=8 d={d} m={m} {dtype}"
    dt = DTYPES[dtype]
    hidden = torch.randn(8, d).to(dt)
    w1, b1 = (torch.randn(m, d) / d**0.5).to(dt), (torch.randn(m) * 0.1).to(dt)
    w2, b2 = (torch.randn(m) / m**0.5).to(dt), torch.zeros(1).to(dt)
    fn = {"eecore": lambda: ops.mlp_confidence(hidden, w1, b1, w2, b2),
          "torch": lambda: torch_mlp_confidence(hidden, w1, b1, w2, b2)}[impl]
    torch.testing.assert_close(fn().float(), torch_mlp_confidence(hidden, w1, b1, w2, b2).float(), rtol=2e-2, atol=1e-2)
    benchmark(fn)


def torch_accept_update(status, confidence, threshold, active):
    status |= (confidence > threshold) & active
    return (active & ~status).sum(dtype=torch.int32)


@pytest.mark.parametrize("batch", [8, 256])
@pytest.mark.parametrize("impl", ["eecore", "torch"])
def test_accept_update(benchmark, impl, batch):
    benchmark.group = f"accept_update B={batch}"
    status = torch.zeros(batch, dtype=torch.bool)
    confidence = torch.rand(batch)
    threshold = torch.rand(batch)
    active = torch.rand(batch) < 0.9
    fn = {"eecore": ops.accept_update, "torch": torch_accept_update}[impl]
    benchmark(fn, status, confidence, threshold, active)
