"""The host's share of a decode step: everything a step costs besides the model's kernels.

    PYTHONPATH=python python bench/cost_host.py [--batch-sizes 1 8 64 256] [--steps 128]
        [--context 64] [--text] [--speculate D [--gpu-preset] [--fused]] [--out-name NAME]

On a GPU a full-depth decode step is one CUDA graph replay, and the host's work around it
(scheduling, filling the step's input buffers, reading the sampled tokens back, appending them,
stop checks) runs while the GPU waits: it adds to every step's time. This measures that work on
any machine: the engine runs its static decode path (the code a graph captures, eagerly) with the
pass itself replaced by a preallocated logits buffer, so each step is host work only. The
vocabulary is small (256) so that the argmax, a kernel on a GPU, costs nothing here either.

With --text the output is detokenized as a server does it: SmolLM2's tokenizer, a stop string
watched, and every sequence's text streamed after every step (the median step then comes from
outputs half as long as --steps).

Prints, per batch size, the median time of a decode step and its parts (schedule, input build,
sample, append and stop checks, streaming); writes bench/results/<machine>/<name>-<date>.json.
"""
from __future__ import annotations

import argparse
import collections
import functools
import statistics
import tempfile
import time

import torch

import eecore
from common import cpu_model, save_results
from eecore.engine.static_decode import StaticDecode
from eecore.engine.streaming import DeltaTracker

VOCAB = 256


def tiny_checkpoint(folder: str, context: int) -> None:
    import transformers

    config = transformers.LlamaConfig(vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                      num_attention_heads=4, num_key_value_heads=2,
                                      max_position_embeddings=max(4096, 2 * context))
    torch.manual_seed(0)
    transformers.LlamaForCausalLM(config).save_pretrained(folder, safe_serialization=True)


class PartTimer:
    """Wraps named methods of objects and adds up the time spent in each between `reset`s."""

    def __init__(self):
        self.seconds: dict[str, float] = collections.defaultdict(float)

    def wrap(self, owner, method: str, label: str) -> None:
        inner = getattr(owner, method)

        @functools.wraps(inner)
        def timed(*args, **kwargs):
            start = time.perf_counter()
            try:
                return inner(*args, **kwargs)
            finally:
                self.seconds[label] += time.perf_counter() - start

        setattr(owner, method, timed)

    def reset(self) -> dict[str, float]:
        out = dict(self.seconds)
        self.seconds.clear()
        return out


def smollm2_tokenizer():
    from eecore.models import default_model_path
    from eecore.models.gguf_file import GGUFFile
    from eecore.models.gguf_tokenizer import tokenizer_from_gguf

    path = default_model_path()
    return tokenizer_from_gguf(GGUFFile(path).metadata, path)


def host_only_engine(folder: str, max_batch: int):
    llm = eecore.LLM(folder, dtype="float32", device="cpu", max_num_seqs=max_batch,
                     max_num_batched_tokens=max(1024, max_batch * 128))
    runner = llm.engine.runner
    static = StaticDecode(runner, max_batch, capture=False)
    logits = torch.randn(max_batch, VOCAB)
    # each sequence repeats one letter: ids 81..106 are "a".."z" in SmolLM2's vocabulary (--text)
    logits[torch.arange(max_batch), 81 + torch.arange(max_batch) % 26] = 100.0
    static.step = lambda inputs: logits  # a graph replay that costs the host nothing
    runner.static_decode = static
    return llm


def host_only_copy_engine(folder: str, max_batch: int, drafts: int, gpu_preset: bool = False,
                          failing: bool = False, acceptance: float = 1.0, fused: bool = False):
    """The exit-ready layer preset's round (a draft copy, d drafts a round) with every pass replaced
    by a buffer: the copy's layers return a state buffer, the draft head and the verify pass logits
    whose argmax is one letter for every row (perfect drafts: each round has d + 1 tokens, the most
    a round handles on the host). `gpu_preset`: with the GPU preset's rules as well (the chain's stop
    below 0.15, long_draft_acceptance, lengths from the draft planner), which read each draft's
    probability and time every round. `failing`: the draft head proposes another letter than the
    verify pass emits, so every draft is rejected (the planner then plans plain rounds). `acceptance`
    below 1: each row of the verify pass's buffer emits another letter with probability 1 -
    acceptance (drawn once, so the same rows reject every round): sequences accept different
    numbers of drafts, so with the planner they draft different lengths, as in a real batch.
    `fused`: fused rounds (LLM(fused_rounds=True)), whose chain and verify-and-accept passes are
    buffers too: the verify pass's result says what the model emits and how many drafts it kept."""
    from eecore.engine.static_decode import StaticVerify

    rules = dict(stop_below=0.15, long_draft_acceptance=0.5) if gpu_preset else {}
    spec = eecore.SelfSpeculativeConfig(num_speculations=drafts, adaptive=gpu_preset,
                                        layer=eecore.LayerDrafts(1, copy=eecore.DraftCopy(), **rules))
    llm = eecore.LLM(folder, dtype="float32", device="cpu", max_num_seqs=max_batch, speculative=spec,
                     max_num_batched_tokens=max(1024, max_batch * 128), fused_rounds=fused)
    runner, decoder = llm.engine.runner, llm.engine.strategy
    stack, width = decoder.draft_stack, decoder.lookahead
    logits = torch.randn(max_batch * width, VOCAB)
    logits[:, 81] = 100.0  # "a"
    if acceptance < 1.0:
        rejecting = torch.rand(max_batch * width, generator=torch.Generator().manual_seed(0)) >= acceptance
        logits[rejecting, 82] = 200.0  # "b": the verify pass disagrees with the draft there
    runner.static_decode = StaticDecode(runner, max_batch, capture=False)
    runner.static_verify = StaticVerify(runner, max_batch, capture=False, width=width)
    runner.static_decode.step = runner.static_verify.step = lambda inputs: logits[: inputs.num_tokens]
    proposals = torch.randn(max_batch * width, VOCAB)
    proposals[:, 82 if failing else 81] = 100.0  # the draft head's letter: "a" as the verify pass, or "b"
    stack.static = stack.static_pass(capture=False)
    stack.static.step = lambda inputs: proposals[: inputs.last_rows.shape[0]]  # the copy's layers and head
    stack.head.columns = lambda hidden: proposals[: hidden.shape[0]]  # the head after op-by-op passes
    if fused:
        results = {}

        def verify_and_accept(inputs, width):  # each row's W tokens, then the drafts kept
            if width not in results:
                result = results[width] = torch.full((max_batch, width + 1), 81, dtype=torch.int64)
                result[:, width] = 0 if failing else width - 1
                if acceptance < 1.0:
                    result[rejecting.view(max_batch, -1)[:, 0], width] = 0
                    result[rejecting.view(max_batch, -1)[:, 0], 0] = 82
            return results[width][: inputs.last_rows.shape[0]]

        decoder.fused.chain.step = lambda inputs, k: None
        decoder.fused.verify.step = verify_and_accept
    return llm


def measure(llm, batch: int, steps: int, context: int, text: bool = False, drafts: int = 0) -> dict:
    engine = llm.engine
    timer = PartTimer()
    timer.wrap(engine.scheduler, "schedule", "schedule")
    timer.wrap(engine.runner.builder, "build", "build")
    timer.wrap(engine.sampler, "sample", "sample")
    timer.wrap(engine, "append_tokens", "append")
    if drafts:  # a self-speculation round's own parts (each includes the builds and samples inside it)
        decoder = engine.strategy
        timer.wrap(decoder.draft_stack, "first_pass", "copy pass")
        timer.wrap(decoder.draft_stack, "next_pass", "copy pass")
        timer.wrap(decoder.picker, "take", "pick drafts")
        timer.wrap(decoder.verifier, "full", "verify")
        timer.wrap(decoder.acceptor, "accept_all", "accept")
        timer.wrap(decoder.proposer, "chain", "chained passes")  # draft ahead (EECORE_DRAFT_AHEAD=1)
        if decoder.fused is not None:
            timer.wrap(decoder.fused.inputs, "fill", "fill round inputs")
            timer.wrap(decoder.fused, "run", "fused round")
    params = eecore.SamplingParams(max_tokens=steps * (drafts + 1) + 1, temperature=0.0, ignore_eos=True,
                                   stop=["never in the output"] if text else None)
    tracker = None
    if text:  # SmolLM2's tokenizer, a stop string watched, every sequence streamed as the server does
        engine.stopper.tokenizer = smollm2_tokenizer()
        tracker = DeltaTracker(engine)
        timer.wrap(tracker, "delta", "stream")
    for i in range(batch):
        engine.add_request([(7 * i + j) % VOCAB for j in range(context)], params, i)
    totals, parts = [], collections.defaultdict(list)
    while engine.has_unfinished():
        timer.reset()
        start = time.perf_counter()
        for seq in engine.step():
            if tracker is not None:
                tracker.delta(seq)
        elapsed = time.perf_counter() - start
        if engine.last_step.prefills or len(engine.last_step.decodes) != batch:
            continue
        totals.append(elapsed)
        for label, seconds in timer.reset().items():
            parts[label].append(seconds)
    us = lambda values: round(statistics.median(values) * 1e6, 1)  # noqa: E731
    return dict(batch=batch, steps=len(totals), step_us=us(totals), per_sequence_us=round(us(totals) / batch, 2),
                tokens_per_sequence_and_step=drafts + 1,
                parts_us={label: us(values) for label, values in parts.items()})


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--batch-sizes", type=int, nargs="+", default=[1, 8, 64, 256])
    ap.add_argument("--steps", type=int, default=128)
    ap.add_argument("--context", type=int, default=64, help="prompt tokens of each sequence")
    ap.add_argument("--text", action="store_true",
                    help="also detokenize: SmolLM2's tokenizer, a stop string, every sequence streamed")
    ap.add_argument("--speculate", type=int, default=0, metavar="D",
                    help="time the exit-ready layer preset's rounds of D drafts (a draft copy; every pass a "
                         "buffer, every draft accepted) instead of decode steps")
    ap.add_argument("--gpu-preset", action="store_true",
                    help="with --speculate: the GPU layer preset's rules too (stop rules, the draft planner)")
    ap.add_argument("--acceptance", type=float, default=1.0,
                    help="with --speculate: the share of the verify pass's rows that agree with the draft "
                         "(drawn once; below 1, sequences accept, and with --gpu-preset draft, different lengths)")
    ap.add_argument("--fused", action="store_true",
                    help="with --speculate: fused rounds (LLM(fused_rounds=True): one host round trip a round)")
    ap.add_argument("--failing-drafts", action="store_true",
                    help="with --speculate: every draft rejected (with --gpu-preset the planner turns drafting off)")
    ap.add_argument("--out-name", default=None, help="(default: host-overhead, or host-overhead-speculate)")
    args = ap.parse_args()
    torch.set_num_threads(1)
    rows = []
    with tempfile.TemporaryDirectory() as folder:
        tiny_checkpoint(folder, args.context)
        for batch in args.batch_sizes:
            llm = host_only_copy_engine(folder, batch, args.speculate, args.gpu_preset, args.failing_drafts,
                                        args.acceptance, args.fused) if args.speculate else \
                host_only_engine(folder, batch)
            row = measure(llm, batch, args.steps, args.context, args.text, args.speculate)
            if args.failing_drafts:
                row["tokens_per_sequence_and_step"] = 1
            rows.append(row)
            parts = ", ".join(f"{k} {v}" for k, v in row["parts_us"].items())
            what = ("step, drafts failing" if args.failing_drafts else f"round of {args.speculate} drafts") \
                if args.speculate else "decode step"
            print(f"batch {batch:4d}: {row['step_us']:8.1f} us a {what} ({row['per_sequence_us']} a sequence); "
                  f"{parts}")
    name = args.out_name or ("host-overhead-speculate" if args.speculate else "host-overhead")
    path = save_results(name, dict(cpu=cpu_model(), steps=args.steps, context=args.context, text=args.text,
                                   speculate=args.speculate, gpu_preset=args.gpu_preset, fused=args.fused,
                                   failing_drafts=args.failing_drafts, acceptance=args.acceptance, rows=rows))
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
