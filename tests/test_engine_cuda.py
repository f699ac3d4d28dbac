"""The whole engine on CUDA: the same requests as on the CPU, through every decoding strategy.

The op tests check each CUDA kernel alone; these check that the runtime drives them correctly on a
GPU (device placement, the KV cache, the exit decision's one host sync, the self-speculation
rollback). fp32 keeps the comparisons exact: on CUDA the fp32 path never uses tensor cores, so the
greedy tokens must equal HF's and the CPU engine's. bf16 is checked against HF's logits with a
tolerance. Skipped where no GPU is visible.
"""
import pytest
import torch

import eecore
from cuda_tests import CUDA_MARKS
from engine_utils import generate_arriving, greedy, hf_greedy, random_prompts
from model_factory import make_tiny_hf_model

pytestmark = CUDA_MARKS

NUM_LAYERS = 4


@pytest.fixture(scope="module", params=["llama", "qwen2"])
def tiny(request, tmp_path_factory):
    return make_tiny_hf_model(tmp_path_factory.mktemp(request.param), arch=request.param, num_layers=NUM_LAYERS)


def _llm(path, device="cuda", dtype="float32", **kw):
    return eecore.LLM(path, dtype=dtype, device=device, num_blocks=128, block_size=8, **kw)


def _without_sync(inner, label: str, calls: list):
    """`inner` run under torch.cuda.set_sync_debug_mode("error"), where an op that synchronizes with the
    host raises (an event's wait is not counted); appends `label` to `calls` each time it ran."""
    def call(*args, **kwargs):
        torch.cuda.set_sync_debug_mode("error")
        try:
            out = inner(*args, **kwargs)
        finally:
            torch.cuda.set_sync_debug_mode("default")
        calls.append(label)
        return out
    return call


def test_default_device_is_cuda(tiny):
    path, _ = tiny
    llm = eecore.LLM(path, dtype="float32", num_blocks=16, block_size=8)
    assert llm.device.type == "cuda"


def test_greedy_tokens_match_hf(tiny):
    path, hf = tiny
    prompts = random_prompts(hf.config.vocab_size, [5, 17, 1, 33], seed=1)
    outs = _llm(path).generate(prompts, greedy(12))
    for prompt, out in zip(prompts, outs):
        assert out.token_ids == hf_greedy(hf, prompt, 12)


def test_bf16_logits_close_to_hf(tiny):
    path, hf = tiny
    llm = _llm(path, dtype="bfloat16")
    prompt = random_prompts(hf.config.vocab_size, [1], seed=2)[0]
    out = llm.generate([prompt], greedy(1, logprobs=5))[0]
    with torch.no_grad():
        expected = torch.log_softmax(hf(torch.tensor([prompt])).logits[0, -1].float(), dim=-1)
    for token, logprob in out.logprobs[0].items():
        assert abs(logprob - expected[token].item()) < 0.1


def test_same_tokens_as_the_cpu_engine_with_preemption(tiny):
    path, hf = tiny
    prompts = random_prompts(hf.config.vocab_size, [9, 3, 21, 14, 7, 30, 2, 11], seed=3)
    on_cpu = [o.token_ids for o in _llm(path, device="cpu").generate(prompts, greedy(16))]
    tight = eecore.LLM(path, dtype="float32", device="cuda", num_blocks=14, block_size=4)
    assert [o.token_ids for o in tight.generate(prompts, greedy(16))] == on_cpu
    assert tight.engine.blocks.num_free_blocks == tight.engine.blocks.num_blocks


@pytest.mark.parametrize("exit_config", [
    dict(measure="static", exit_layer=2),
    dict(measure="cosine", threshold=0.5),
    dict(measure="softmax", threshold=0.3, batch_rule="compact"),
])
def test_early_exit_same_as_on_the_cpu(tiny, exit_config):
    path, hf = tiny
    prompts = random_prompts(hf.config.vocab_size, [4, 7, 12], seed=4)
    runs = [_llm(path, device=device, early_exit=eecore.EarlyExitConfig(**exit_config)).generate(prompts, greedy(10))
            for device in ("cpu", "cuda")]
    assert [o.token_ids for o in runs[1]] == [o.token_ids for o in runs[0]]
    assert [o.exit_layers for o in runs[1]] == [o.exit_layers for o in runs[0]]


@pytest.mark.parametrize("E, d", [(1, 3), (2, 2), (3, 6)])
def test_greedy_self_speculation_is_full_depth_greedy(tiny, E, d):
    path, hf = tiny
    prompts = random_prompts(hf.config.vocab_size, [2 + (7 * i) % 13 for i in range(5)], seed=5)
    params = [greedy(5 + 3 * i) for i in range(5)]
    full = _llm(path).generate(prompts, params)
    spec = _llm(path, speculative=eecore.SelfSpeculativeConfig(exit_layer=E, num_speculations=d))
    assert [o.token_ids for o in spec.generate(prompts, params)] == [o.token_ids for o in full]
    assert spec.engine.blocks.num_free_blocks == spec.engine.blocks.num_blocks


def test_input_builder_never_overwrites_a_pending_copy():
    """Two steps built back to back with no sync between them (self-speculation's last draft pass,
    then its verify pass) while the stream is busy: the first step must still get its own inputs.
    Without the wait in InputBuilder.build, the queued copy of step 1 reads the pinned host buffers
    after step 2 has overwritten them."""
    from eecore.engine.inputs import InputBuilder, Row
    from eecore.engine.sequence import Sequence

    builder = InputBuilder(max_tokens=64, max_seqs=4, max_blocks_per_seq=4, block_size=8, device=torch.device("cuda"))
    seq = Sequence([1, 2, 3], eecore.SamplingParams(max_tokens=4))
    seq.block_table = [0, 1]
    torch.cuda.synchronize()
    torch.cuda._sleep(200_000_000)  # ~0.1 s of GPU work queued ahead of step 1's copies
    first = builder.build([Row(seq, 0, [11, 12, 13])])
    first_tokens = first.token_ids.clone()  # stream-ordered after step 1's copy
    builder.build([Row(seq, 3, [99])])
    assert first_tokens.tolist() == [11, 12, 13]


def test_token_trees_are_full_depth(tiny):
    """Greedy token-tree verification (DraftCopy(top_k=k > 1)) on CUDA gives the CPU engine's tokens."""
    path, hf = tiny
    spec = eecore.SelfSpeculativeConfig(num_speculations=2,
                                        layer=eecore.LayerDrafts(exit_layer=1, copy=eecore.DraftCopy(top_k=3)))
    prompts = random_prompts(hf.config.vocab_size, [5, 17, 3], seed=4)
    outs = _llm(path, speculative=spec).generate(prompts, greedy(16))
    cpu = _llm(path, device="cpu").generate(prompts, greedy(16))
    assert [o.token_ids for o in outs] == [o.token_ids for o in cpu]
    assert sum(o.metrics["num_tree_alternatives"] for o in outs) > 0


# ---- CUDA graphs of the decode step (eecore.engine.static_decode) ----------------------------

@pytest.mark.parametrize("num_prompts", [1, 3, 6, 11])
def test_graphs_give_eager_tokens_and_logprobs(tiny, num_prompts):
    """Captured and replayed decode steps against enforce_eager=True: requests finish on different
    steps, so the batch passes through several padded sizes (11 -> 16, 6 -> 8, 3 -> 4, ...)."""
    path, hf = tiny
    prompts = random_prompts(hf.config.vocab_size, [2 + (5 * i) % 13 for i in range(num_prompts)], seed=7)
    params = [greedy(3 + 2 * i, logprobs=3) for i in range(num_prompts)]
    eager = _llm(path, max_num_seqs=16, enforce_eager=True).generate(prompts, params)
    llm = _llm(path, max_num_seqs=16)
    graphed = llm.generate(prompts, params)
    assert llm.engine.runner.static_decode.graphs, "no decode step was captured"
    assert [o.token_ids for o in graphed] == [o.token_ids for o in eager]
    for a, b in zip(graphed, eager):
        for step_a, step_b in zip(a.logprobs, b.logprobs):
            assert step_a.keys() == step_b.keys()
            assert all(abs(step_a[t] - step_b[t]) < 1e-4 for t in step_a)


@pytest.mark.parametrize("switch", ["EECORE_PREPARE_NEXT_STEP", "EECORE_DECODE_AHEAD"])
@pytest.mark.parametrize("num_blocks", [128, 14])  # 14 blocks of 4: preemption
def test_graphs_with_the_host_ahead_give_eager_tokens(tiny, switch, num_blocks, monkeypatch):
    """EECORE_PREPARE_NEXT_STEP=1: each step's inputs filled in on the host while the step before
    runs. EECORE_DECODE_AHEAD=1: each step launched before the one before it is read back, its
    tokens copied from that step's argmax on the stream. Same tokens as eager mode either way."""
    path, hf = tiny
    prompts = random_prompts(hf.config.vocab_size, [9, 3, 21, 14, 7, 30, 2, 11], seed=8)
    params = [greedy(5 + 3 * i) for i in range(len(prompts))]
    eager = eecore.LLM(path, dtype="float32", device="cuda", num_blocks=num_blocks, block_size=4,
                       enforce_eager=True).generate(prompts, params)
    monkeypatch.setenv(switch, "1")
    if switch == "EECORE_PREPARE_NEXT_STEP":  # decode ahead, on by default on a GPU, prepares steps itself
        monkeypatch.setenv("EECORE_DECODE_AHEAD", "0")
    llm = eecore.LLM(path, dtype="float32", device="cuda", num_blocks=num_blocks, block_size=4)
    graphed = llm.generate(prompts, params)
    if switch == "EECORE_PREPARE_NEXT_STEP":
        assert llm.engine.runner.builder.prepared_steps > 0
    else:
        assert llm.engine.runner.static_decode.ahead_taken > 0
    assert [o.token_ids for o in graphed] == [o.token_ids for o in eager]
    assert llm.engine.blocks.num_free_blocks == llm.engine.blocks.num_blocks
    # requests arriving while others decode (steps mixing decodes with prompt chunks between)
    runs = [generate_arriving(_llm(path, max_num_batched_tokens=48, enforce_eager=eager_mode), prompts, params)
            for eager_mode in (True, False)]
    assert [o.token_ids for o in runs[1]] == [o.token_ids for o in runs[0]]


def test_sampled_steps_launched_ahead_give_eager_tokens(tiny, monkeypatch):
    """EECORE_DECODE_AHEAD=1 with sampled rows (temperature, top-k, top-p; seeded) and logprobs:
    the draws are made on the device and feed the next step's inputs, the log-probabilities are
    read back with the tokens; same tokens and logprobs as eager mode."""
    path, hf = tiny
    prompts = random_prompts(hf.config.vocab_size, [9, 3, 21, 14, 7], seed=18)
    params = [eecore.SamplingParams(max_tokens=6 + 2 * i, temperature=0.8, top_k=20 if i % 2 else 0,
                                    top_p=0.9 if i == 2 else 1.0, logprobs=2 if i < 2 else None, seed=i,
                                    ignore_eos=True) for i in range(len(prompts))]
    eager = eecore.LLM(path, dtype="float32", device="cuda", num_blocks=64, block_size=4,
                       enforce_eager=True).generate(prompts, params)
    monkeypatch.setenv("EECORE_DECODE_AHEAD", "1")
    llm = eecore.LLM(path, dtype="float32", device="cuda", num_blocks=64, block_size=4)
    outs = llm.generate(prompts, params)
    assert [o.token_ids for o in outs] == [o.token_ids for o in eager]
    assert [o.logprobs for o in outs] == [o.logprobs for o in eager]
    assert llm.engine.runner.static_decode.ahead_taken > 0


def test_sampled_steps_launch_ahead_without_a_host_sync(tiny, monkeypatch):
    """Temperature and top-k rows (seeded and not, beside a greedy one, some with logprobs): nothing
    between a decode step's launch and its successor's waits for the GPU (the sampling parameters and
    row indices reach the device through pinned memory: engine.transfer.device_tensor), so decode ahead
    overlaps sampled steps as it does greedy ones. Under torch.cuda.set_sync_debug_mode("error") a
    synchronizing op in the draws, the log-probabilities' tensors or the launch raises."""
    from eecore.engine import decoding

    path, hf = tiny
    prompts = random_prompts(hf.config.vocab_size, [9, 3, 21, 14, 7], seed=18)
    params = [eecore.SamplingParams(max_tokens=12, temperature=0.0 if i == 4 else 0.8, top_k=20 if i % 2 else 0,
                                    logprobs=2 if i < 2 else None, seed=i if i < 3 else None, ignore_eos=True)
              for i in range(len(prompts))]
    monkeypatch.setenv("EECORE_DECODE_AHEAD", "1")
    llm = eecore.LLM(path, dtype="float32", device="cuda", num_blocks=64, block_size=4)
    expected = llm.generate(prompts, params)  # captures the graphs (a capture synchronizes)
    checked = []
    decoder, static = llm.engine.strategy, llm.engine.runner.static_decode
    decoder.sampler.draw_sampled = _without_sync(decoder.sampler.draw_sampled, "draws", checked)
    static.launch_ahead = _without_sync(static.launch_ahead, "launch", checked)
    monkeypatch.setattr(decoding, "logprob_tensors", _without_sync(decoding.logprob_tensors, "logprobs", checked))
    monkeypatch.setattr(decoding, "device_tensor", _without_sync(decoding.device_tensor, "rows", checked))
    outs = llm.generate(prompts, params)
    assert {"draws", "launch", "logprobs", "rows"} <= set(checked)
    same = (0, 1, 2, 4)  # the seeded rows and the greedy one (the unseeded row's draws go on from the first run)
    assert [outs[i].token_ids for i in same] == [expected[i].token_ids for i in same]
    assert static.ahead_taken > 0


def test_the_argmax_op_gives_atens_tokens(tiny, monkeypatch):
    """Every greedy token from eecore's argmax op, the default on a GPU (graphs, a step launched
    ahead, verify-free full depth); the same tokens as ATen's max (EECORE_ARGMAX_KERNEL=aten) in
    eager mode."""
    path, hf = tiny
    prompts = random_prompts(hf.config.vocab_size, [9, 3, 21, 14], seed=19)
    params = [greedy(5 + 3 * i) for i in range(len(prompts))]
    monkeypatch.setenv("EECORE_ARGMAX_KERNEL", "aten")
    eager = eecore.LLM(path, dtype="float32", device="cuda", num_blocks=64, block_size=4,
                       enforce_eager=True).generate(prompts, params)
    monkeypatch.delenv("EECORE_ARGMAX_KERNEL")
    monkeypatch.setenv("EECORE_DECODE_AHEAD", "1")
    llm = eecore.LLM(path, dtype="float32", device="cuda", num_blocks=64, block_size=4)
    assert [o.token_ids for o in llm.generate(prompts, params)] == [o.token_ids for o in eager]


@pytest.mark.parametrize("max_rows", ["16", "2"])  # 2: the batch's first steps fetch nothing
def test_weight_prefetch_gives_eager_tokens(tiny, max_rows, monkeypatch):
    """EECORE_PREFETCH_WEIGHTS=1: each layer forks a side stream that asks L2 for the projections
    after attention; graphs capture the fork and join. Same tokens and logprobs as eager mode
    without it."""
    path, hf = tiny
    prompts = random_prompts(hf.config.vocab_size, [9, 3, 21, 14], seed=20)
    params = [greedy(4 + 3 * i, logprobs=2) for i in range(len(prompts))]
    eager = eecore.LLM(path, dtype="float32", device="cuda", num_blocks=64, block_size=4,
                       enforce_eager=True).generate(prompts, params)
    monkeypatch.setenv("EECORE_PREFETCH_WEIGHTS", "1")
    monkeypatch.setenv("EECORE_PREFETCH_MAX_ROWS", max_rows)
    llm = eecore.LLM(path, dtype="float32", device="cuda", num_blocks=64, block_size=4)
    outs = llm.generate(prompts, params)
    assert [o.token_ids for o in outs] == [o.token_ids for o in eager]
    assert [o.logprobs for o in outs] == [o.logprobs for o in eager]
    assert llm.engine.runner.model.prefetch.forks > 0


@pytest.mark.parametrize("drafts", ["layer", "copy"])
def test_batch_invariant_self_speculation_is_full_depth_at_batch_40(tiny, drafts, batch_invariant):
    """EECORE_BATCH_INVARIANT=1 (bf16): a verify pass of 4 rows a sequence gives each row a decode
    step's bits, so 40 sequences drafting through layer 1 (the model's own layers, or a draft copy)
    emit exactly full depth's greedy tokens, with graphs."""
    path, hf = tiny
    prompts = random_prompts(hf.config.vocab_size, [3 + (7 * i) % 29 for i in range(40)], seed=21)
    params = greedy(24)
    full = eecore.LLM(path, dtype="bfloat16", device="cuda", num_blocks=512, block_size=8,
                      max_num_seqs=40).generate(prompts, params)
    layer = eecore.LayerDrafts(exit_layer=1, copy=eecore.DraftCopy() if drafts == "copy" else None)
    spec = eecore.LLM(path, dtype="bfloat16", device="cuda", num_blocks=512, block_size=8, max_num_seqs=40,
                      speculative=eecore.SelfSpeculativeConfig(num_speculations=3, layer=layer))
    assert [o.token_ids for o in spec.generate(prompts, params)] == [o.token_ids for o in full]


def test_graphs_per_table_width_give_eager_tokens(tiny):
    """Graphs keyed by a block-table width bucket too (the attention kernel plans its context splits
    by the width): the batch moves from 16 blocks of 8 to 8 when its longest sequence finishes,
    then to 16 and 32 as another grows; same tokens and logprobs as enforce_eager=True."""
    path, hf = tiny
    prompts = random_prompts(hf.config.vocab_size, [3, 40, 100], seed=17)
    params = [greedy(20, logprobs=2), greedy(100, logprobs=2), greedy(6, logprobs=2)]
    eager = _llm(path, enforce_eager=True).generate(prompts, params)
    llm = _llm(path)
    graphed = llm.generate(prompts, params)
    assert {key[1] for key in llm.engine.runner.static_decode.graphs} >= {8, 16, 32}
    assert [o.token_ids for o in graphed] == [o.token_ids for o in eager]
    for a, b in zip(graphed, eager):
        for step_a, step_b in zip(a.logprobs, b.logprobs):
            assert all(abs(step_a[t] - step_b[t]) < 1e-4 for t in step_a.keys() & step_b.keys())


def test_graphs_with_preemption_and_bf16(tiny):
    path, hf = tiny
    prompts = random_prompts(hf.config.vocab_size, [9, 3, 21, 14, 7, 30, 2, 11], seed=3)
    eager = eecore.LLM(path, dtype="float32", device="cuda", num_blocks=14, block_size=4, enforce_eager=True)
    tight = eecore.LLM(path, dtype="float32", device="cuda", num_blocks=14, block_size=4)
    assert [o.token_ids for o in tight.generate(prompts, greedy(16))] == \
        [o.token_ids for o in eager.generate(prompts, greedy(16))]
    assert tight.engine.blocks.num_free_blocks == tight.engine.blocks.num_blocks
    # bf16: the same graphs on the tensor-core attention kernels; close to eager's logits
    outs = [_llm(path, dtype="bfloat16", enforce_eager=eager_mode).generate(prompts[:3], greedy(1, logprobs=5))
            for eager_mode in (True, False)]
    for a, b in zip(*outs):
        for token in a.logprobs[0].keys() & b.logprobs[0].keys():
            assert abs(a.logprobs[0][token] - b.logprobs[0][token]) < 0.05


@pytest.mark.parametrize("draft", ["lookup", "copy", "hybrid-token", "copy-tree"])
def test_graphs_of_the_verify_pass_give_eager_tokens(tiny, draft, monkeypatch):
    """Self-speculation's verify pass captured per padded batch at the round's verify width, and a
    draft copy's one-token passes, against enforce_eager=True: same tokens and logprobs (token
    trees: EECORE_TREE_GRAPHS=1)."""
    monkeypatch.setenv("EECORE_TREE_GRAPHS", "1")
    path, hf = tiny
    spec = {"lookup": lambda: eecore.SelfSpeculativeConfig(num_speculations=3, lookup=eecore.LookupDrafts()),
            "copy": lambda: eecore.SelfSpeculativeConfig(num_speculations=3, layer=eecore.LayerDrafts(
                1, copy=eecore.DraftCopy())),
            "copy-tree": lambda: eecore.SelfSpeculativeConfig(num_speculations=2, layer=eecore.LayerDrafts(
                1, copy=eecore.DraftCopy(top_k=3))),
            "hybrid-token": lambda: eecore.SelfSpeculativeConfig(
                num_speculations=4, layer=eecore.LayerDrafts(1, max_length=2, copy=eecore.DraftCopy()),
                lookup=eecore.LookupDrafts(min_ngram=2), hybrid_switch="token")}[draft]
    prompts = random_prompts(hf.config.vocab_size, [3, 9, 17, 5, 12], seed=11)
    prompts = [p + p[: len(p) // 2] + p for p in prompts]  # repeats: prompt lookup finds matches
    params = [greedy(6 + 3 * i, logprobs=2) for i in range(len(prompts))]
    eager = _llm(path, speculative=spec(), enforce_eager=True).generate(prompts, params)
    llm = _llm(path, speculative=spec())
    graphed = llm.generate(prompts, params)
    assert llm.engine.runner.static_verify.graphs, "no verify pass was captured"
    stack = llm.engine.strategy.draft_stack
    if stack is not None:
        assert stack.static.graphs, "no draft copy pass was captured"
    assert [o.token_ids for o in graphed] == [o.token_ids for o in eager]
    # lossless verification hides wrong draft rows (row 0 alone decides the token): the graphed
    # pass must accept exactly what the eager one does
    assert [o.metrics["num_accepted_tokens"] for o in graphed] == [o.metrics["num_accepted_tokens"] for o in eager]
    for a, b in zip(graphed, eager):
        for step_a, step_b in zip(a.logprobs, b.logprobs):
            assert all(abs(step_a[t] - step_b[t]) < 1e-4 for t in step_a.keys() & step_b.keys())


@pytest.mark.parametrize("spec", [dict(num_speculations=3, layer=dict(exit_layer=1)),
                                  dict(num_speculations=3, layer=dict(exit_layer=2), lookup=dict(min_ngram=2))])
def test_graphs_of_layerskip_passes_give_eager_tokens(tiny, spec, monkeypatch):
    """LayerSkip's draft passes through layers 0..E-1 and its verify pass from the exit-query cache,
    captured per padded batch, against enforce_eager=True: same tokens, accepted drafts and logprobs."""
    monkeypatch.delenv("EECORE_LAYERSKIP_GRAPHS", raising=False)  # the default: on
    path, hf = tiny

    def config():
        return eecore.SelfSpeculativeConfig(num_speculations=spec["num_speculations"],
                                            layer=eecore.LayerDrafts(**spec["layer"]),
                                            lookup=eecore.LookupDrafts(**spec["lookup"]) if "lookup" in spec else None)

    prompts = random_prompts(hf.config.vocab_size, [3, 9, 17, 5, 12], seed=11)
    prompts = [p + p[: len(p) // 2] + p for p in prompts]
    params = [greedy(6 + 3 * i, logprobs=2) for i in range(len(prompts))]
    eager = _llm(path, speculative=config(), enforce_eager=True).generate(prompts, params)
    llm = _llm(path, speculative=config())
    graphed = llm.generate(prompts, params)
    decoder = llm.engine.strategy
    assert decoder.proposer.static.graphs and decoder.verifier.static_from_exit_states.graphs, "nothing was captured"
    assert [o.token_ids for o in graphed] == [o.token_ids for o in eager]
    assert [o.metrics["num_accepted_tokens"] for o in graphed] == [o.metrics["num_accepted_tokens"] for o in eager]
    for a, b in zip(graphed, eager):
        for step_a, step_b in zip(a.logprobs, b.logprobs):
            assert all(abs(step_a[t] - step_b[t]) < 1e-4 for t in step_a.keys() & step_b.keys())


@pytest.mark.parametrize("early_exit", [dict(measure="softmax", threshold=3e-5), dict(measure="cosine", threshold=0.5),
                                        dict(measure="static", exit_layer=1)])
def test_graphs_of_early_exit_segments_give_eager_tokens(tiny, early_exit):
    """Early exit's iteration (rule "all", static exits) captured as one graph per segment between
    two checks, against enforce_eager=True: same tokens, exit layers and logprobs."""
    path, hf = tiny
    prompts = random_prompts(hf.config.vocab_size, [3, 9, 17, 5, 12, 2, 7], seed=5)
    params = [greedy(5 + 2 * i, logprobs=2) for i in range(len(prompts))]
    eager = _llm(path, early_exit=eecore.EarlyExitConfig(**early_exit), enforce_eager=True).generate(prompts, params)
    llm = _llm(path, early_exit=eecore.EarlyExitConfig(**early_exit))
    graphed = llm.generate(prompts, params)
    assert llm.engine.strategy.static.graphs, "no segment was captured"
    assert [o.token_ids for o in graphed] == [o.token_ids for o in eager]
    assert [o.exit_layers for o in graphed] == [o.exit_layers for o in eager]
    for a, b in zip(graphed, eager):
        for step_a, step_b in zip(a.logprobs, b.logprobs):
            assert all(abs(step_a[t] - step_b[t]) < 1e-4 for t in step_a.keys() & step_b.keys())


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_piecewise_graphs_give_eager_tokens(tiny, dtype, monkeypatch):
    """Prefill chunks and mixed steps with everything but attention captured per token bucket
    (eecore.engine.piecewise), against enforce_eager=True: same tokens and logprobs in fp32, close
    logprobs in bf16; prompts arrive while others decode, long ones are chunked."""
    monkeypatch.delenv("EECORE_PIECEWISE_GRAPHS", raising=False)  # the default: on
    path, hf = tiny
    prompts = random_prompts(hf.config.vocab_size, [3, 29, 7, 61, 1, 16, 40, 90], seed=13)
    params = [greedy(5 + 3 * i, logprobs=3) for i in range(len(prompts))]
    eager = generate_arriving(_llm(path, dtype=dtype, max_num_batched_tokens=48, enforce_eager=True), prompts, params)
    llm = _llm(path, dtype=dtype, max_num_batched_tokens=48)
    graphed = generate_arriving(llm, prompts, params)
    assert len(llm.engine.runner.piecewise.graphs) >= 3 * (NUM_LAYERS + 1), "too few buckets were captured"
    if dtype == "float32":
        assert [o.token_ids for o in graphed] == [o.token_ids for o in eager]
    tolerance = 1e-4 if dtype == "float32" else 0.05
    for a, b in zip(graphed, eager):
        first_a, first_b = a.logprobs[0], b.logprobs[0]  # the first token's: a prefill's logits
        assert all(abs(first_a[t] - first_b[t]) < tolerance for t in first_a.keys() & first_b.keys())
        if dtype == "float32":
            for step_a, step_b in zip(a.logprobs, b.logprobs):
                assert all(abs(step_a[t] - step_b[t]) < tolerance for t in step_a.keys() & step_b.keys())


def test_graphed_copy_rounds_after_fully_accepted_ones(tiny):
    """Perfect drafts (full depth's own tokens) through a draft copy with graphs: every round after
    the first opens with the copy's two-token catch-up, captured as a graph of its own; every draft
    is accepted and the tokens are full depth's."""
    from test_static_decode import _draft_full_depths_tokens

    path, hf = tiny
    prompts = random_prompts(hf.config.vocab_size, [3, 9, 17, 5, 12], seed=11)
    params = greedy(16)
    expected = {tuple(p): o.token_ids for p, o in zip(prompts, _llm(path, enforce_eager=True).generate(prompts, params))}
    llm = _llm(path, speculative=eecore.SelfSpeculativeConfig(
        num_speculations=3, layer=eecore.LayerDrafts(1, copy=eecore.DraftCopy())))
    decoder = llm.engine.strategy
    _draft_full_depths_tokens(decoder, expected)
    outs = llm.generate(prompts, params)
    assert [o.token_ids for o in outs] == [expected[tuple(p)] for p in prompts]
    assert sum(o.metrics["num_accepted_tokens"] for o in outs) == sum(o.metrics["num_drafted_tokens"] for o in outs)
    assert any(key[-1] == 2 for key in decoder.draft_stack.static.graphs)


@pytest.mark.parametrize("verify_ahead", [False, True])
@pytest.mark.parametrize("stops", [False, True])
def test_draft_ahead_with_graphs_drafts_what_the_pass_by_pass_chain_does(tiny, stops, verify_ahead, monkeypatch):
    """EECORE_DRAFT_AHEAD=1 on a GPU: the copy's passes take their tokens on the device, captured as
    graphs; the tokens are those of the pass-by-pass chain, and so are the drafts where no stop
    rule makes the two run different batches. EECORE_VERIFY_AHEAD=1: the verify pass as well, from
    the chain's tokens on the device."""

    path, hf = tiny
    prompts = random_prompts(hf.config.vocab_size, [3, 9, 17, 5, 12, 7], seed=11)
    prompts = [p + p[: len(p) // 2] + p for p in prompts]
    params = greedy(20)
    layer = eecore.LayerDrafts(1, stop_below=0.0045 if stops else None, copy=eecore.DraftCopy())
    monkeypatch.setenv("EECORE_VERIFY_AHEAD", "1" if verify_ahead else "0")
    runs, verified = [], []
    for ahead in ("0", "1"):
        monkeypatch.setenv("EECORE_DRAFT_AHEAD", ahead)
        llm = _llm(path, speculative=eecore.SelfSpeculativeConfig(num_speculations=4, layer=layer))
        static = llm.engine.runner.static_verify
        inner = static.run_with_tokens
        static.run_with_tokens = lambda *args: verified.append(ahead) or inner(*args)
        runs.append(llm.generate(prompts, params))
    plain, ahead = runs
    assert [o.token_ids for o in ahead] == [o.token_ids for o in plain]
    if not stops:  # (with a stop rule the chain's later passes hold more rows, which may round otherwise)
        for key in ("num_drafted_tokens", "num_accepted_tokens"):
            assert [o.metrics[key] for o in ahead] == [o.metrics[key] for o in plain]
    assert set(verified) == ({"1"} if verify_ahead else set())  # verified ahead: behind chains only


@pytest.mark.parametrize("ahead", ["0", "1"])
def test_graphed_draft_passes_built_from_the_last_pass_draft_what_fresh_builds_draft(tiny, ahead, monkeypatch):
    """InputBuilder.advance on a GPU (pinned host arrays, one copy a pass, graph replays): a round's
    later copy passes built from the last pass's arrays draft what passes built anew draft."""
    from eecore.engine.inputs import InputBuilder

    path, hf = tiny
    prompts = random_prompts(hf.config.vocab_size, [3, 9, 17, 5, 12, 7], seed=11)
    prompts = [p + p[: len(p) // 2] + p for p in prompts]
    params = greedy(20)
    monkeypatch.setenv("EECORE_DRAFT_AHEAD", ahead)
    runs = []
    for advance in (True, False):
        if not advance:
            monkeypatch.setattr(InputBuilder, "advance", lambda self, rows, pad_to: None)
        llm = _llm(path, speculative=eecore.SelfSpeculativeConfig(
            num_speculations=4, layer=eecore.LayerDrafts(1, copy=eecore.DraftCopy())))
        runs.append((llm.generate(prompts, params), llm.engine.strategy.draft_stack.runner.builder.advanced_steps))
    (advanced, steps), (fresh, none) = runs
    assert steps > 0 and none == 0
    assert [o.token_ids for o in advanced] == [o.token_ids for o in fresh]
    for key in ("num_drafted_tokens", "num_accepted_tokens"):
        assert [o.metrics[key] for o in advanced] == [o.metrics[key] for o in fresh]


@pytest.mark.parametrize("verify_ahead", [False, True])
def test_draft_ahead_launches_its_chain_without_a_host_sync(tiny, verify_ahead, monkeypatch):
    """The chain's indices, passes and draft head reads go out with nothing read back, and with
    EECORE_VERIFY_AHEAD=1 so does the verify pass behind them: under
    torch.cuda.set_sync_debug_mode("error") any op in them that synchronizes with the host raises
    (the builder's wait for the previous pass's input copy is an event, which it does not count)."""
    from eecore.speculative.verification import VerifyAhead

    path, hf = tiny
    prompts = random_prompts(hf.config.vocab_size, [3, 9, 17, 5], seed=11)
    monkeypatch.setenv("EECORE_DRAFT_AHEAD", "1")
    monkeypatch.setenv("EECORE_VERIFY_AHEAD", "1" if verify_ahead else "0")
    llm = _llm(path, speculative=eecore.SelfSpeculativeConfig(num_speculations=4, layer=eecore.LayerDrafts(
        1, copy=eecore.DraftCopy())))
    llm.generate(prompts, greedy(16))  # captures the graphs (a capture synchronizes) that the run below replays
    proposer, launched = llm.engine.strategy.proposer, []
    proposer._to_device = _without_sync(proposer._to_device, "indices", launched)  # (behind the round's first pass)
    proposer.launch_chain = _without_sync(proposer.launch_chain, "chain", launched)
    monkeypatch.setattr(VerifyAhead, "launch", _without_sync(VerifyAhead.launch, "verify", launched))  # (self first)
    llm.generate(prompts, greedy(16))
    assert {"indices", "chain"} <= set(launched) and ("verify" in launched) == verify_ahead


def test_plain_rounds_of_a_planner_that_stopped_drafting_launch_ahead_with_graphs(tiny, monkeypatch):
    """The draft planner priced every draft out (a verify row costs a step): its plain rounds are
    graphed decode steps, each launching the next ahead, with eager mode's tokens."""
    from eecore.speculative.draft_planner import DraftPlanner
    from test_draft_planner import StubClock

    monkeypatch.setattr(DraftPlanner, "FIRST_PROBE_WAIT", 4)
    path, hf = tiny
    prompts = random_prompts(hf.config.vocab_size, [3, 9, 17, 5, 12], seed=11)
    params = [greedy(12 + 4 * i) for i in range(len(prompts))]
    eager = _llm(path, enforce_eager=True).generate(prompts, params)
    llm = _llm(path, speculative=eecore.SelfSpeculativeConfig(
        num_speculations=3, adaptive=True, layer=eecore.LayerDrafts(1, copy=eecore.DraftCopy())))
    llm.engine.strategy.planner.clock = StubClock(lambda rows: float(rows), copy=0.01)
    outs = llm.generate(prompts, params)
    assert [o.token_ids for o in outs] == [o.token_ids for o in eager]
    assert llm.engine.runner.static_decode.ahead_taken > 0
    assert llm.engine.blocks.num_free_blocks == llm.engine.blocks.num_blocks


def test_fused_rounds_with_graphs_give_full_depths_tokens(tiny):
    """LLM(fused_rounds=True) on a GPU: the copy's passes and the verify-and-accept pass captured as
    graphs per padded batch, fed by one input copy a round: full depth's greedy tokens; and with
    every draft accepted (eecore.testing.accept_every_draft, acceptance inside the graph) a round
    emits d + 1 tokens a sequence."""
    from eecore.testing import accept_every_draft

    path, hf = tiny
    prompts = random_prompts(hf.config.vocab_size, [3, 9, 17, 5, 12, 7], seed=11)
    prompts = [p + p[: len(p) // 2] + p for p in prompts]
    params = greedy(20)
    expected = [o.token_ids for o in _llm(path, enforce_eager=True).generate(prompts, params)]
    spec = eecore.SelfSpeculativeConfig(num_speculations=3, layer=eecore.LayerDrafts(1, copy=eecore.DraftCopy()))
    llm = _llm(path, fused_rounds=True, speculative=spec)
    outs = llm.generate(prompts, params)
    assert [o.token_ids for o in outs] == expected
    fused = llm.engine.strategy.fused
    assert fused.rounds > 0 and fused.chain.graphs and fused.verify.graphs
    perfect = _llm(path, fused_rounds=True, speculative=spec)
    accept_every_draft(perfect)
    outs = perfect.generate(prompts, params)
    assert all(o.metrics["num_accepted_tokens"] == o.metrics["num_drafted_tokens"] for o in outs)
    assert all(o.metrics["mean_accepted_tokens_per_step"] > 3 for o in outs)


def test_fused_rounds_launch_their_passes_without_a_host_sync(tiny):
    """Between a fused round's input copy and its read-back nothing waits for the GPU: under
    torch.cuda.set_sync_debug_mode("error") any op in the passes that synchronizes raises."""
    path, hf = tiny
    prompts = random_prompts(hf.config.vocab_size, [3, 9, 17, 5], seed=11)
    llm = _llm(path, fused_rounds=True, speculative=eecore.SelfSpeculativeConfig(
        num_speculations=4, layer=eecore.LayerDrafts(1, copy=eecore.DraftCopy())))
    llm.generate(prompts, greedy(16))  # captures the graphs (a capture synchronizes) that the run below replays
    fused, launched = llm.engine.strategy.fused, []
    fused.chain.launch = _without_sync(fused.chain.launch, "chain", launched)
    fused.verify.launch = _without_sync(fused.verify.launch, "verify", launched)
    llm.generate(prompts, greedy(16))
    assert {"chain", "verify"} <= set(launched)


@pytest.fixture(scope="module")
def feature_head(tiny, tmp_path_factory):
    """A feature head for the tiny model, as initialized (what it drafts does not matter here: the
    graphs must draft what eager mode drafts)."""
    from eecore.models.feature_head import FeatureHead

    out = str(tmp_path_factory.mktemp("head") / "head.safetensors")
    FeatureHead.initialized(eecore.LLM(tiny[0], dtype="float32", device="cpu").model).save(out)
    return out


@pytest.mark.parametrize("adaptive, top_k", [(False, 1), (True, 1), (False, 3)])
def test_graphs_of_feature_drafts_give_eager_tokens_and_drafts(tiny, feature_head, adaptive, top_k, monkeypatch):
    """EECORE_FEATURE_GRAPHS=1 and EECORE_TREE_GRAPHS=1: the head's steps, and the verify passes
    (of chains, and of token trees with top_k=3) and plain steps that tap the target's states for
    it, as CUDA graphs, against enforce_eager=True: same tokens, and (fixed lengths) the same drafts."""
    monkeypatch.setenv("EECORE_FEATURE_GRAPHS", "1")
    monkeypatch.setenv("EECORE_TREE_GRAPHS", "1")
    path, hf = tiny
    spec = lambda: eecore.SelfSpeculativeConfig(num_speculations=3, adaptive=adaptive,  # noqa: E731
                                                feature=eecore.FeatureDrafts(head=feature_head, top_k=top_k))
    prompts = random_prompts(hf.config.vocab_size, [3, 9, 17, 5, 12], seed=11)
    params = [greedy(6 + 3 * i) for i in range(len(prompts))]
    engines = _llm(path, speculative=spec(), enforce_eager=True), _llm(path, speculative=spec())
    drafted = []
    for llm in engines:
        picker, seen = llm.engine.strategy.features.picker, []

        def spy(logits, rows, seqs, drafts, take=picker.take, seen=seen, **kw):
            kept, ended = take(logits, rows, seqs, drafts, **kw)
            seen.append([(drafts[b].tokens[-1], drafts[b].alternatives[-1] if top_k > 1 else None) for b in kept])
            return kept, ended
        picker.take = spy
        drafted.append(seen)
    eager, graphed = (llm.generate(prompts, params) for llm in engines)
    assert [o.token_ids for o in graphed] == [o.token_ids for o in eager]
    if not adaptive:
        assert drafted[1] == drafted[0]
    steps, runner = engines[1].engine.strategy.features.static, engines[1].engine.runner
    assert steps is not None and steps.graphs, "the head's steps were not captured"
    assert any(k[-1] == steps.head.taps for k in runner.static_verify.graphs), "no tapped verify pass was captured"
    if top_k > 1:
        assert any("tree" in k for k in runner.static_verify.graphs), "no tree's verify pass was captured"
