"""How many tokens per verify round can drafts that run no layer reach on held-out prompts? Exact, no
timing: greedy output does not depend on the drafts, so one full-depth greedy run per prompt says
what any drafter would have had accepted in every round.

Drafters compared (SmolLM2-135M, held-out prompts of `--prompts` kind, `--max-tokens` greedy tokens):
- `prompt`: eecore's prompt lookup (eecore.text.ngram_index.NgramIndex, min/max n-gram 1/3),
  d tokens per round;
- `prompt, k candidates`: the k most recent distinct continuations of the matched n-grams, all
  verified at once (tree verification), counted as the best of them: what multi-candidate lookup
  could add at k x d verify rows;
- `prompt + corpus`: where the prompt has no match, a static n-gram table of the training corpus
  (eecore.sources.corpus, 12.6 M tokens, llama.cpp's `lookup-static` idea): the most frequent next
  token after the last 3, 2 or 1 tokens, chained, kept while seen >= `min_count` times and
  >= `min_share` of that context's continuations. With `--answers DIR` the table is built from the
  model's own answers instead (the train split of a `python -m eecore.train.generated_corpus`
  folder: its chat and everyday answers), what a server could learn from the requests it served.

    python bench/analysis/lookup_ceiling.py [--prompts code|chat|everyday] [--answers DIR]
        [--num-prompts 40] [--max-tokens 64] [--drafts 4 6 8]

writes bench/results/<machine>/lookup-ceiling-<date>.json. The verify cost of a round is not modelled: on
2 CPU cores, 1-6 rows cost about the same (1.0-1.16x a one-row step), 7-10 rows 1.4-1.55x.
"""
from __future__ import annotations

import argparse
import os
import sys

import numpy as np

import eecore

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # bench/: common.py
from common import PROMPT_KINDS, GreedyReplay, bench_prompt_ids, cpu_model, save_results  # noqa: E402

SEPARATOR = 65535  # between files in the token stream (not a SmolLM2 token id)
ASSISTANT = "<|im_start|>assistant\n"  # where an answer starts in SmolLM2's chat template


def corpus_tokens(tokenizer, answers: str | None = None) -> np.ndarray:
    """The token stream the static table is built from: the training corpus's files, or with
    `answers` (a generated-corpus folder) the answers of its train split, each after the last few
    tokens of its chat template (so that the table also knows how answers start)."""
    from eecore.sources.corpus import FILE_SEPARATOR, build_corpus

    if answers is None:
        texts = [f.text for f in build_corpus().train]
    else:
        with open(os.path.join(answers, "train.txt")) as f:
            samples = [t for t in f.read().split(FILE_SEPARATOR) if ASSISTANT in t]
        texts = [ASSISTANT + t.split(ASSISTANT, 1)[1] for t in samples]
    pieces = []
    for i in range(0, len(texts), 256):
        for enc in tokenizer.backend.encode_batch(texts[i:i + 256], add_special_tokens=False):
            pieces += [np.asarray(enc.ids, dtype=np.uint64), np.asarray([SEPARATOR], dtype=np.uint64)]
    return np.concatenate(pieces)


class CorpusNgrams:
    """Most frequent continuation of every 1-, 2- and 3-token context of the corpus (ids < 2^16,
    so a context and its next token pack into one uint64)."""

    def __init__(self, ids: np.ndarray):
        self.tables = {}
        for n in (1, 2, 3):
            count = ids.size - n
            key, bad = np.zeros(count, dtype=np.uint64), np.zeros(count, dtype=bool)
            for j in range(n + 1):
                part = ids[j:j + count]
                bad |= part == SEPARATOR
                key = (key << np.uint64(16)) | part
            pairs, counts = np.unique(key[~bad], return_counts=True)
            context = pairs >> np.uint64(16)
            starts = np.r_[0, np.nonzero(np.diff(context))[0] + 1]
            order = np.lexsort((counts, context))  # within a context, the most frequent last
            best = order[np.r_[starts[1:], context.size] - 1]
            self.tables[n] = (context[starts], (pairs[best] & np.uint64(0xFFFF)).astype(np.int64), counts[best],
                              np.add.reduceat(counts, starts))

    def next_token(self, tokens: list[int], min_count: int, min_share: float):
        for n in (3, 2, 1):
            if len(tokens) < n:
                continue
            key = 0
            for t in tokens[-n:]:
                key = (key << 16) | t
            contexts, best, best_count, total = self.tables[n]
            i = int(np.searchsorted(contexts, np.uint64(key)))
            if i < contexts.size and contexts[i] == key:
                ok = best_count[i] >= min_count and best_count[i] / total[i] >= min_share
                return int(best[i]) if ok else None
        return None


def candidates(tokens: list[int], d: int, k: int, lo: int = 1, hi: int = 3) -> list[list[int]]:
    found: list[list[int]] = []
    for n in range(min(hi, len(tokens) - 1), lo - 1, -1):
        suffix = tokens[len(tokens) - n:]
        for s in range(len(tokens) - n - 1, -1, -1):
            if tokens[s:s + n] == suffix:
                c = tokens[s + n:s + n + d]
                if c and c not in found:
                    found.append(c)
                    if len(found) == k:
                        return found
    return found


def rounds(refs, propose) -> dict:
    """Simulated verify rounds: `propose(context, index) -> list of candidate drafts`, of which the
    round keeps the one that emits the most."""
    num_rounds = emitted = rows = 0
    for prompt, out in refs:
        replay = GreedyReplay(prompt, out, 1, 3)
        while not replay.done:
            drafts = propose(prompt + out[:replay.pos], replay.index)
            best = max(drafts, key=replay.emitted, default=[])
            emitted += replay.advance(best)
            num_rounds += 1
            rows += 1 + sum(len(d) for d in drafts)
    return dict(tokens_per_round=emitted / num_rounds, rows_per_round=rows / num_rounds)


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--prompts", choices=PROMPT_KINDS, default="code")
    ap.add_argument("--answers", default=None, metavar="DIR",
                    help="build the static table from a generated corpus's answers, not the training corpus")
    ap.add_argument("--num-prompts", type=int, default=40)
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--drafts", type=int, nargs="+", default=[4, 6, 8])
    ap.add_argument("--out-name", default="lookup-ceiling")
    args = ap.parse_args()

    llm = eecore.LLM(dtype="float32", device="cpu", max_num_seqs=8)
    prompts = bench_prompt_ids(llm.tokenizer, args.prompts, args.num_prompts)
    # code runs on for the whole length; a chat answer ends at its end of turn
    outs = llm.generate(prompts, eecore.SamplingParams(max_tokens=args.max_tokens, ignore_eos=args.prompts == "code"))
    refs = [(p, o.token_ids) for p, o in zip(prompts, outs)]
    print(f"CPU: {cpu_model()}; {len(refs)} held-out {args.prompts} prompts, {args.max_tokens} greedy tokens; "
          f"building the {'answers' if args.answers else 'corpus'} n-gram table ...", flush=True)
    corpus = CorpusNgrams(corpus_tokens(llm.tokenizer, args.answers))

    def chain(context, first, d, min_count, min_share):
        draft = list(first)
        while len(draft) < d:
            t = corpus.next_token(context + draft, min_count, min_share)
            if t is None:
                break
            draft.append(t)
        return draft

    rows = []
    for d in args.drafts:
        configs = {"prompt": lambda ctx, ix, d=d: [ix.propose(d)]}
        for k in (2, 3):
            configs[f"prompt, {k} candidates"] = lambda ctx, ix, d=d, k=k: candidates(ctx, d, k)
        for min_count, min_share in ((2, 0.3), (4, 0.6)):
            configs[f"prompt + corpus (count >= {min_count}, share >= {min_share})"] = (
                lambda ctx, ix, d=d, c=min_count, s=min_share: [ix.propose(d) or chain(ctx, [], d, c, s)])
        configs["corpus only (count >= 2, share >= 0.3)"] = lambda ctx, ix, d=d: [chain(ctx, [], d, 2, 0.3)]
        for name, propose in configs.items():
            row = dict(d=d, drafter=name, **rounds(refs, propose))
            rows.append(row)
            print(f"d={d} {name:45s} {row['tokens_per_round']:.3f} tokens/round, "
                  f"{row['rows_per_round']:.2f} verify rows/round", flush=True)
    path = save_results(args.out_name, dict(model="SmolLM2-135M-Instruct", prompts=args.prompts, answers=args.answers,
                                            num_prompts=len(refs), max_tokens=args.max_tokens, rows=rows))
    print(f"results: {path}")


if __name__ == "__main__":
    main()
