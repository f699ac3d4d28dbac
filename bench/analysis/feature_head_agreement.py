"""How often feature heads draft the model's own greedy tokens, by kind of text: the head's first
k drafts all right (k = 1..--drafts), on the held-out answers of generated corpora.

    PYTHONPATH=python python bench/analysis/feature_head_agreement.py --heads A.safetensors B.safetensors \
        [--corpus gen/ gen2/ ...] [--bench-kinds chat everyday code] [--documents 32] [--drafts 3] [--by-confidence]

Each held-out document of each corpus (`python -m eecore.train.generated_corpus`: a prompt and the
model's continuation) runs through the model (its Hugging Face twin, fp32) once; from every
position of its answer the head unrolls as it drafts in the engine (the target's tapped streams at
p and the token at p + 1, then its own states and drafts), and a draft is right when it equals the
model's greedy token over the whole vocabulary (so the draft vocabulary's misses count as misses).
Kinds: "code" (completions: the continuation's last 128 tokens), "everyday" (requests naming a
held-out everyday topic, eecore.sources.general_chat_prompts) and "technical chat" (the other
requests). `--bench-kinds` adds the benches' own held-out prompts (bench/common.py: "chat" is the
CLI's chat prompts, general questions and a poem) continued greedily by the model for 64 tokens,
as bench/e2e_feature_head.py runs them. Prints one line a head and kind, with the share of the
model's greedy tokens there that the head's draft vocabulary holds (a draft it lacks is a miss);
writes nothing.
"""
from __future__ import annotations

import argparse
import collections
import dataclasses
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # bench/: common.py
import eecore  # noqa: E402
from common import bench_prompt_ids  # noqa: E402
from eecore.models.feature_head import FeatureHead  # noqa: E402
from eecore.sources.corpus import FILE_SEPARATOR  # noqa: E402
from eecore.sources.general_chat_prompts import HELDOUT_TOPICS  # noqa: E402
from eecore.train.feature_head import FeatureHeadConfig, FeatureHeadTrainer  # noqa: E402

ANSWER = "<|im_start|>assistant\n"
USER = "<|im_start|>user\n"


def documents_by_kind(tokenizer, folders: list[str], per_kind: int) -> dict[str, list[tuple[list[int], int]]]:
    """kind -> [(token ids, where the answer starts)], at most `per_kind` each."""
    kinds = collections.defaultdict(list)
    for folder in folders:
        with open(os.path.join(folder, "heldout.txt")) as f:
            for doc in f.read().split(FILE_SEPARATOR):
                ids = tokenizer.encode(doc, add_special_tokens=False)
                if ANSWER in doc:
                    user = doc.split(USER, 1)[-1].split("<|im_end|>")[0].lower()
                    kind = "everyday" if any(t.lower() in user for t in HELDOUT_TOPICS) else "technical chat"
                    start = len(tokenizer.encode(doc.split(ANSWER, 1)[0] + ANSWER, add_special_tokens=False))
                else:
                    kind, start = "code", max(0, len(ids) - 128)
                kinds[kind].append((ids, start))
    return {kind: docs[:per_kind] for kind, docs in kinds.items()}


def bench_documents(llm, kinds: list[str], per_kind: int, max_tokens: int = 64) -> dict:
    """kind -> [(token ids, where the answer starts)]: the benches' prompts of each kind and the
    model's greedy continuation of each."""
    params = eecore.SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
    documents = {}
    for kind in kinds:
        prompts = bench_prompt_ids(llm.tokenizer, kind, per_kind)
        documents[f"bench {kind}"] = [(list(p) + list(o.token_ids), len(p))
                                      for p, o in zip(prompts, llm.generate(prompts, params))]
    return documents


def unrolls(trainer: FeatureHeadTrainer, docs, depth: int):
    """For each document with answer positions that have `depth` tokens after them: (those positions,
    the head's start state there, the token at each position + 1, the model's greedy token after
    every position of the document and its probability). Run it under torch.no_grad()."""
    head = trainer.head
    for ids, start in docs:
        positions = torch.arange(max(start - 1, 0), len(ids) - depth - 1)
        if len(positions) == 0:
            continue
        window = torch.tensor([ids])
        out = trainer.hf(input_ids=window, output_hidden_states=True)
        features = torch.cat([out.hidden_states[t] for t in head.taps], dim=-1)[0]
        sure, greedy = out.logits[0].float().softmax(-1).max(-1)
        yield positions, head.start_state(features[positions]), window[0, positions + 1], greedy, sure


CONFIDENCE_EDGES = (0.0, 0.3, 0.5, 0.7, 0.9, 1.0)


@dataclasses.dataclass
class Agreement:
    right: list[float]   # share of answer positions whose first k drafts are all right, k = 1..drafts
    held: float          # share of the model's greedy tokens there that the head's draft vocabulary holds
    # per band of the model's probability of its own token (CONFIDENCE_EDGES): (share of the
    # positions in it, how often the first draft is right there)
    bands: list[tuple[float, float]]


def agreement(trainer: FeatureHeadTrainer, docs, drafts: int) -> Agreement:
    """The head unrolled `drafts` deep from every answer position of `docs`, against the model's
    greedy tokens (one pass of the model a document)."""
    head = trainer.head
    right = [[] for _ in range(drafts)]
    held_ids = torch.zeros(trainer.embed.shape[0], dtype=torch.bool)
    held_ids[head.vocab if head.vocab is not None else slice(None)] = True
    held, sure = [], []
    with torch.no_grad():
        for positions, state, token, greedy, probability in unrolls(trainer, docs, drafts):
            held.append(held_ids[greedy[positions + 1]].float())
            sure.append(probability[positions + 1])
            keys, all_right = None, None
            for j in range(drafts):
                state, logits, keys = head.step(state, trainer.embed[token], trainer.head_rows, keys)
                token = logits.argmax(-1) if head.vocab is None else head.vocab[logits.argmax(-1)]
                hit = token == greedy[positions + 1 + j]
                all_right = hit if all_right is None else all_right & hit
                right[j].append(all_right.float())
    first, sure = torch.cat(right[0]), torch.cat(sure)
    bands = []
    for low, high in zip(CONFIDENCE_EDGES, CONFIDENCE_EDGES[1:]):
        inside = (sure >= low) & ((sure < high) if high < 1.0 else (sure <= high))
        bands.append((round(float(inside.float().mean()), 2),
                      round(float(first[inside].mean()), 2) if inside.any() else float("nan")))
    return Agreement([round(float(torch.cat(r).mean()), 3) for r in right], round(float(torch.cat(held).mean()), 3),
                     bands)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--heads", nargs="+", required=True, help="feature head files")
    ap.add_argument("--corpus", nargs="+", default=[], help="generated corpus folders (their heldout.txt)")
    ap.add_argument("--bench-kinds", nargs="+", default=[], choices=("chat", "everyday", "code"),
                    help="also the benches' prompts of these kinds, continued greedily by the model")
    ap.add_argument("--documents", type=int, default=32, help="held-out documents of each kind")
    ap.add_argument("--drafts", type=int, default=3)
    ap.add_argument("--by-confidence", action="store_true", help="also the first draft's agreement by how sure "
                    "the model is of its own token (bands of its probability)")
    args = ap.parse_args()
    if not args.corpus and not args.bench_kinds:
        ap.error("give --corpus, --bench-kinds or both")
    llm = eecore.LLM(dtype="float32", device="cpu", quantization="none")
    kinds = documents_by_kind(llm.tokenizer, args.corpus, args.documents)
    kinds.update(bench_documents(llm, args.bench_kinds, args.documents))
    for path in args.heads:
        head = FeatureHead.load(path, llm.model)
        trainer = FeatureHeadTrainer(llm, FeatureHeadConfig(drafts=args.drafts), head.vocab, head=head)
        for kind, docs in sorted(kinds.items()):
            found = agreement(trainer, docs, args.drafts)
            print(f"{os.path.basename(path):50s} {kind:15s} {len(docs):3d} documents  first k right, k = 1..: "
                  f"{found.right}  greedy tokens in its vocabulary {found.held}", flush=True)
            if args.by_confidence:
                print("    model's probability of its token: " + ", ".join(
                    f"[{low}, {high}{']' if high == 1.0 else ')'} {share:.2f} of positions, first draft right {hit:.2f}"
                    for (low, high), (share, hit) in zip(zip(CONFIDENCE_EDGES, CONFIDENCE_EDGES[1:]), found.bands)),
                      flush=True)


if __name__ == "__main__":
    main()
