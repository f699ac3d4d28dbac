"""Where a self-speculation round's time goes at batch 1 (CPU): the draft passes, the verify pass and
the acceptance, timed around SelfSpeculativeDecoder's methods, next to full depth's time per token.

    python bench/spec_round_cost.py --exit-adapter FILE --exit-layer 8 --num-speculations 2 [--prompts 4]

A round costs the first E layers once per draft plus once more (the last draft's layer-E state
feeds the verify pass), then layers E..L-1 over d + 1 positions; at batch 1 each pass is bound by
reading weights, so the printout shows whether the round costs what that model says or more.
"""
from __future__ import annotations

import argparse
import collections
import functools
import time

import eecore
from common import cpu_model
from eecore.prompts import heldout_code_prompts
from eecore.speculative.decoder import SelfSpeculativeDecoder

PARTS = ("_draft", "_verify", "_accept", "decode")


def instrument() -> tuple[dict, collections.Counter]:
    seconds, calls = collections.defaultdict(float), collections.Counter()
    for name in PARTS:
        method = getattr(SelfSpeculativeDecoder, name)

        @functools.wraps(method)
        def timed(*args, _method=method, _name=name, **kwargs):
            start = time.perf_counter()
            result = _method(*args, **kwargs)
            seconds[_name] += time.perf_counter() - start
            calls[_name] += 1
            return result

        setattr(SelfSpeculativeDecoder, name, timed)
    return seconds, calls


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--exit-adapter", nargs="?", const=True, default=None, metavar="FILE")
    ap.add_argument("--exit-layer", type=int, default=8)
    ap.add_argument("--num-speculations", type=int, default=2)
    ap.add_argument("--prompts", type=int, default=4)
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--repeats", type=int, default=2)
    args = ap.parse_args()
    seconds, calls = instrument()
    prompts = heldout_code_prompts(args.prompts)
    params = eecore.SamplingParams(max_tokens=args.max_tokens, temperature=0.0)
    kw = dict(dtype="float32", device="cpu", max_num_seqs=1, exit_adapter=args.exit_adapter)
    llms = {"full": eecore.LLM(**kw),
            "spec": eecore.LLM(**kw, speculative=eecore.SelfSpeculativeConfig(
                exit_layer=args.exit_layer, num_speculations=args.num_speculations))}
    print(f"CPU: {cpu_model()}; E={args.exit_layer}, d={args.num_speculations}, {len(prompts)} code prompts")
    for r in range(args.repeats):
        for name, llm in llms.items():
            seconds.clear()
            calls.clear()
            start, tokens = time.perf_counter(), 0
            for prompt in prompts:  # one at a time: batch 1
                tokens += len(llm.generate([prompt], params)[0].token_ids)
            elapsed = time.perf_counter() - start
            print(f"repeat {r} {name}: {1000 * elapsed / tokens:.2f} ms/token")
        rounds = max(calls["decode"], 1)
        parts = ", ".join(f"{name.strip('_')} {1000 * seconds[name] / max(calls[name], 1):.2f} ms"
                          for name in PARTS)
        print(f"  {rounds} rounds, {tokens / rounds:.2f} tokens each; per call: {parts}")


if __name__ == "__main__":
    main()
