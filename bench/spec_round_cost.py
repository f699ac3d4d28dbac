"""Where a self-speculation round's time goes (CPU): the draft passes, the verify pass and the
acceptance, timed around the decoder's and the draft copy's methods, next to full depth's time per
token.

    python bench/spec_round_cost.py --exit-adapter [FILE] --exit-layer 8 --num-speculations 2 [--prompts 4]
        [--batch 1] [--draft-layers shared|separate] [--draft-dtype int8] [--dtype float32|bfloat16]

At batch 1 the prompts run one at a time; with `--batch B` they run B at a time (`--prompts` of
them in all), the way a server batches them. A round with shared layers costs the first E layers
once per draft plus once more (the last draft's layer-E state feeds the verify pass), then layers
E..L-1 over d + 1 positions; with a separate draft copy it costs the copy's passes (the first of a
sequence also catches the copy up on its prompt) and a full-depth pass over d + 1 positions. At
batch 1 each pass is bound by reading weights, so the printout shows whether the round costs what
that model says or more; at larger batches it shows what the extra verify rows and the copy cost.
Each part is printed as its total and its time per call; parts a configuration never calls are
left out.
"""
from __future__ import annotations

import argparse
import collections
import functools
import time

import eecore
from common import cpu_model
from eecore.evaluation.prompts import heldout_code_prompts
from eecore.speculative.acceptance import Acceptor
from eecore.speculative.decoder import SelfSpeculativeDecoder
from eecore.speculative.draft_stack import DraftStack
from eecore.speculative.proposers import SharedLayerProposer
from eecore.speculative.verification import Verifier

# (owner, method, label): the decoder's steps, and the separate draft copy's passes
PARTS = ((SelfSpeculativeDecoder, "decode", "decode"),
         (SharedLayerProposer, "propose", "draft"),
         (Verifier, "from_exit_states", "verify"),
         (Verifier, "full", "verify_all"),
         (Acceptor, "accept_all", "accept_all"),
         (DraftStack, "first_pass", "copy.first_pass"),
         (DraftStack, "next_pass", "copy.next_pass"))


def instrument() -> tuple[dict, collections.Counter]:
    seconds, calls = collections.defaultdict(float), collections.Counter()
    for owner, name, label in PARTS:
        method = getattr(owner, name)

        @functools.wraps(method)
        def timed(*args, _method=method, _label=label, **kwargs):
            start = time.perf_counter()
            result = _method(*args, **kwargs)
            seconds[_label] += time.perf_counter() - start
            calls[_label] += 1
            return result

        setattr(owner, name, timed)
    return seconds, calls


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--exit-adapter", nargs="?", const=True, default=None, metavar="FILE")
    ap.add_argument("--exit-layer", type=int, default=8)
    ap.add_argument("--num-speculations", type=int, default=2)
    ap.add_argument("--prompts", type=int, default=4)
    ap.add_argument("--batch", type=int, default=1, help="prompts generated at once")
    ap.add_argument("--draft-layers", choices=["shared", "separate"], default="shared")
    ap.add_argument("--draft-dtype", default=None, help="--draft-layers separate: the copy's dtype")
    ap.add_argument("--dtype", choices=["float32", "bfloat16"], default="float32", help="the model's dtype")
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--repeats", type=int, default=2)
    args = ap.parse_args()
    if args.batch < 1:
        ap.error(f"--batch must be >= 1, got {args.batch}")
    seconds, calls = instrument()
    prompts = heldout_code_prompts(args.prompts)
    params = eecore.SamplingParams(max_tokens=args.max_tokens, temperature=0.0)
    kw = dict(dtype=args.dtype, device="cpu", max_num_seqs=args.batch, exit_adapter=args.exit_adapter)
    llms = {"full": eecore.LLM(**kw),
            "spec": eecore.LLM(**kw, speculative=eecore.SelfSpeculativeConfig(
                exit_layer=args.exit_layer, num_speculations=args.num_speculations,
                draft_layers=args.draft_layers, draft_dtype=args.draft_dtype))}
    print(f"CPU: {cpu_model()}; E={args.exit_layer}, d={args.num_speculations}, draft layers {args.draft_layers}"
          f"{'' if args.draft_dtype is None else ' (' + args.draft_dtype + ')'}, {len(prompts)} code prompts, "
          f"batch {args.batch}")
    for r in range(args.repeats):
        for name, llm in llms.items():
            seconds.clear()
            calls.clear()
            start, tokens = time.perf_counter(), 0
            for i in range(0, len(prompts), args.batch):
                tokens += sum(len(o.token_ids) for o in llm.generate(prompts[i:i + args.batch], params))
            elapsed = time.perf_counter() - start
            print(f"repeat {r} {name}: {elapsed:.2f} s, {1000 * elapsed / tokens:.2f} ms/token")
        rounds = max(calls["decode"], 1)
        parts = ", ".join(f"{label} {seconds[label]:.2f} s ({1000 * seconds[label] / calls[label]:.2f} ms x {calls[label]})"
                          for _, _, label in PARTS if calls[label])
        print(f"  {rounds} decode steps, {tokens / rounds:.2f} tokens each; {parts}")


if __name__ == "__main__":
    main()
