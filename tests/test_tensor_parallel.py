"""Tensor parallelism on the CPU (gloo): a tiny random Llama split over 2 and 4 worker processes gives
what one process gives (logits, greedy tokens, exits, accepted drafts), makes the collectives the
cost model counts, and fails with a clear error, never a hang, when a rank dies or stops."""
from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

import httpx
import pytest
import torch

import eecore
from eecore.distributed import TensorParallelError
from engine_utils import greedy, random_prompts
from model_factory import make_tiny_hf_model, write_gguf
from serve_utils import start_server_process

NUM_LAYERS = 3
# 8 query heads, 4 KV heads, 128 MLP units: 1, 2 and 4 ranks split them; a vocabulary of 322 leaves
# the last of 4 ranks 2 padding rows
SHAPE = dict(num_layers=NUM_LAYERS, num_heads=8, num_kv_heads=4, hidden_size=64, intermediate_size=128,
             vocab_size=322)


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    path, hf = make_tiny_hf_model(tmp_path_factory.mktemp("tp"), **SHAPE)
    with torch.no_grad():  # peaked distributions, so that softmax exits happen at some layers and not others
        hf.lm_head.weight.mul_(30.0)
    hf.save_pretrained(path)
    return path, hf


def _llm(path, tp=1, **kw):
    kw.setdefault("block_size", 4)
    return eecore.LLM(path, dtype="float32", device="cpu", max_num_seqs=4, tensor_parallel_size=tp, **kw)


def _outputs(path, prompts, params, tp, **kw):
    llm = _llm(path, tp, **kw)
    try:
        return llm.generate(prompts, params), (dict(llm.tp_group.counts) if llm.tp_group else {})
    finally:
        llm.shutdown()


def test_full_depth_logprobs_and_tokens_match_one_process(tiny):
    path, hf = tiny
    prompts = random_prompts(hf.config.vocab_size, [5, 9, 2, 7])
    params = greedy(10, logprobs=3)
    one, _ = _outputs(path, prompts, params, 1)
    for tp in (2, 4):
        many, _ = _outputs(path, prompts, params, tp)
        for a, b in zip(one, many):
            assert a.token_ids == b.token_ids, tp
            for la, lb in zip(a.logprobs, b.logprobs):
                assert la.keys() == lb.keys()
                assert max(abs(la[t] - lb[t]) for t in la) < 1e-4


def test_a_decode_step_makes_two_all_reduces_a_layer(tiny):
    """The embedding's all-reduce, two a layer, and the logits' all-gather: per step, nothing else."""
    path, hf = tiny
    n = 6
    _, counts = _outputs(path, random_prompts(hf.config.vocab_size, [4]), greedy(n), 2)
    steps = n  # the prompt's pass, then n - 1 decode steps
    assert counts == {"all_reduce": steps * (2 * NUM_LAYERS + 1), "all_gather": steps}


def test_early_exit_takes_the_same_exits(tiny):
    """Softmax exits over the vocabulary-split head: one all-gather a check, the same tokens and
    exit layers as one process."""
    path, hf = tiny
    prompts = random_prompts(hf.config.vocab_size, [5, 9, 2])
    ee = eecore.EarlyExitConfig(measure="softmax", threshold=0.2)
    one, _ = _outputs(path, prompts, greedy(12), 1, early_exit=ee)
    two, _ = _outputs(path, prompts, greedy(12), 2, early_exit=ee)
    assert [o.token_ids for o in one] == [o.token_ids for o in two]
    assert [o.exit_layers for o in one] == [o.exit_layers for o in two]
    exits = [e for o in one for e in o.exit_layers]
    assert min(exits) < NUM_LAYERS and max(exits) == NUM_LAYERS  # the threshold exits some tokens, not all


def test_an_exit_check_makes_one_collective(tiny):
    """One sequence: an all-reduce for its embedding and two a layer that ran; an all-gather per exit
    check (at layers 1.. while it has not exited, L - 1 at most) and per full-depth token's logits
    (a token that exits is the check's own top-1)."""
    path, hf = tiny
    ee = eecore.EarlyExitConfig(measure="softmax", threshold=0.2)
    (out,), counts = _outputs(path, random_prompts(hf.config.vocab_size, [5]), greedy(12), 2, early_exit=ee)
    exits = out.exit_layers
    assert min(exits) < NUM_LAYERS
    checks = sum(min(e, NUM_LAYERS - 1) for e in exits[1:])  # the prompt's token is never checked
    assert counts == {"all_reduce": sum(1 + 2 * e for e in exits),
                      "all_gather": checks + sum(e == NUM_LAYERS for e in exits)}


@pytest.mark.parametrize("drafts", ["layer", "lookup", "copy"])
def test_self_speculation_equals_full_depth(tiny, drafts):
    path, hf = tiny
    layer = None if drafts == "lookup" else eecore.LayerDrafts(
        exit_layer=1, copy=eecore.DraftCopy() if drafts == "copy" else None)
    spec = eecore.SelfSpeculativeConfig(num_speculations=3, layer=layer,
                                        lookup=eecore.LookupDrafts() if drafts == "lookup" else None)
    prompts = random_prompts(hf.config.vocab_size, [6, 3]) + [[11, 12, 13, 11, 12, 13, 11, 12]]
    full, _ = _outputs(path, prompts, greedy(12), 1)
    one, _ = _outputs(path, prompts, greedy(12), 1, speculative=spec)
    two, _ = _outputs(path, prompts, greedy(12), 2, speculative=spec)
    assert [o.token_ids for o in two] == [o.token_ids for o in full]
    assert [o.metrics.get("draft_acceptance_rate") for o in two] == \
        [o.metrics.get("draft_acceptance_rate") for o in one]


def test_gguf_blocks_split_on_block_boundaries(tiny, tmp_path):
    path, hf = tiny
    gguf = write_gguf(hf, tmp_path / "tiny-q8.gguf", tokenizer_dir=path, qtype="Q8_0")
    prompts = random_prompts(hf.config.vocab_size, [5, 8])
    one, _ = _outputs(str(gguf), prompts, greedy(8), 1)
    two, _ = _outputs(str(gguf), prompts, greedy(8), 2)
    assert [o.token_ids for o in one] == [o.token_ids for o in two]
    with pytest.raises(ValueError, match="block boundaries"):
        _llm(str(gguf), 4)  # down_proj: 128 inputs in blocks of 32 do not split 4 ways... on 32-value blocks


def test_sizes_that_do_not_split_are_refused_before_any_worker_starts(tiny):
    path, _ = tiny
    with pytest.raises(ValueError, match="must divide the model's num_heads"):
        _llm(path, 3)
    with pytest.raises(ValueError, match="tensor_parallel_size must be a positive int"):
        _llm(path, 0)
    with pytest.raises(ValueError, match="distributed_timeout_s"):
        _llm(path, 2, distributed_timeout_s=-1)


@pytest.mark.parametrize("how", [signal.SIGKILL, signal.SIGSTOP])
def test_a_worker_that_dies_or_stops_fails_the_engine_in_bounded_time(tiny, how):
    path, hf = tiny
    llm = _llm(path, 2, distributed_timeout_s=3)
    try:
        llm.generate(random_prompts(hf.config.vocab_size, [4]), greedy(2))
        worker = llm.workers.processes[0]
        os.kill(worker.pid, how)
        start = time.monotonic()
        with pytest.raises(TensorParallelError, match="rank"):
            llm.generate(random_prompts(hf.config.vocab_size, [4]), greedy(4))
        assert time.monotonic() - start < 20
    finally:
        llm.workers.processes[0].kill()
        llm.shutdown()


def test_the_server_answers_503_and_exits_when_a_worker_dies(tiny):
    path, _ = tiny
    proc, url = start_server_process(path, "--tensor-parallel-size", "2", "--distributed-timeout", "3")
    try:
        body = {"model": os.path.basename(path), "prompt": "Hello", "max_tokens": 4, "temperature": 0}
        assert httpx.post(f"{url}/v1/completions", json=body, timeout=30).status_code == 200
        workers = subprocess.run(["pgrep", "-P", str(proc.pid)], capture_output=True, text=True).stdout.split()
        assert len(workers) == 1
        os.kill(int(workers[0]), signal.SIGKILL)
        r = httpx.post(f"{url}/v1/completions", json=body, timeout=30)
        assert r.status_code == 503 and "rank" in r.json()["error"]["message"]
        assert proc.wait(timeout=20) == 1
        output = proc.communicate()[0]
        assert "the engine stopped" in output and "Traceback" not in output, output[-3000:]
    finally:
        proc.kill()


def test_ranks_started_by_torchrun(tiny, tmp_path):
    """Under torchrun every process runs the script: rank 0's LLM generates, rank 1's follows it and
    ends its process when rank 0 shuts down."""
    path, hf = tiny
    script = tmp_path / "run.py"
    script.write_text(
        "import eecore\n"
        f"llm = eecore.LLM({path!r}, dtype='float32', device='cpu', tensor_parallel_size=2, block_size=4)\n"
        "out = llm.generate([[5, 6, 7, 8]], eecore.SamplingParams(max_tokens=8, temperature=0))\n"
        "print('TOKENS', out[0].token_ids, flush=True)\n"
        "llm.shutdown()\n")
    run = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
                          str(script)], capture_output=True, text=True, timeout=120)
    assert run.returncode == 0, run.stderr[-3000:]
    expected = _llm(path).generate([[5, 6, 7, 8]], greedy(8))[0].token_ids
    assert run.stdout.count("TOKENS") == 1 and f"TOKENS {expected}" in run.stdout


def test_sampled_requests_keep_the_ranks_in_step(tiny):
    """Sampling (seeded and by the engine's generator) draws the same tokens on every rank: a rank
    that drew another would leave lockstep and fail the run."""
    path, hf = tiny
    prompts = random_prompts(hf.config.vocab_size, [5, 9, 2])
    params = [eecore.SamplingParams(max_tokens=10, temperature=0.8, seed=7),
              eecore.SamplingParams(max_tokens=10, temperature=1.0, top_p=0.9),
              eecore.SamplingParams(max_tokens=10, temperature=0.7, top_k=20, seed=3)]
    first, _ = _outputs(path, prompts, params, 2)
    again, _ = _outputs(path, prompts, params, 2)
    assert [o.token_ids for o in first] == [o.token_ids for o in again]
    assert all(len(o.token_ids) == 10 for o in first)
