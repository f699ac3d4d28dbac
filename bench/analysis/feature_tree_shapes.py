"""What a round of the feature head's token tree yields by shape, on held-out answers: fixed trees
(a chain of d tokens and the k - 1 runners-up at each of its positions) against trees of the same
number of nodes taken as the most likely ones (token_tree.most_likely_nodes: among the chain and
k runners-up a position, the nodes whose path probability under the head is highest).

    PYTHONPATH=python python bench/analysis/feature_tree_shapes.py --corpus gen/ [gen2/ ...] \
        [--head FILE] [--documents 12] [--depth 3]

From every position of each held-out answer (bench/analysis/feature_head_agreement.py's documents
and kinds) the head drafts its chain `--depth` deep as it does in the engine, keeping each
position's top 4 tokens and their probabilities; a tree yields the model's greedy tokens it holds
along the model's path (a chain token accepted lets the next position count; a runner-up accepted
ends the round), plus the model's own token. Prints, per kind, tokens a round and the nodes each
shape verifies; writes nothing.
"""
from __future__ import annotations

import argparse
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import eecore  # noqa: E402
from eecore.models.feature_head import SHIPPED_FILE, FeatureHead  # noqa: E402
from eecore.speculative.token_tree import most_likely_nodes  # noqa: E402
from eecore.train.feature_head import FeatureHeadConfig, FeatureHeadTrainer  # noqa: E402
from feature_head_agreement import documents_by_kind, unrolls  # noqa: E402

CANDIDATES = 4  # tokens kept a position: the chain's and 3 runners-up

# (label, chain depth, tokens a position) of the fixed trees; (label, depth, nodes) of the likeliest
FIXED = [("chain d=1", 1, 1), ("chain d=2", 2, 1), ("fixed d=1 k=3", 1, 3), ("fixed d=2 k=2", 2, 2),
         ("fixed d=2 k=3 (the preset's)", 2, 3)]
LIKELIEST = [("likeliest 2 nodes, d<=2", 2, 2), ("likeliest 4 nodes, d<=2", 2, 4), ("likeliest 6 nodes, d<=2", 2, 6),
             ("likeliest 6 nodes, d<=3", 3, 6), ("likeliest 8 nodes, d<=3", 3, 8)]


def tree_yield(keep: int, kept: list[list[int]], chain: list[int], target: list[int]) -> int:
    """Drafted tokens a tree (the first `keep` chain tokens, runners-up `kept` a position) gets right."""
    got = 0
    for j in range(keep):
        if chain[j] == target[j]:
            got += 1
            continue
        return got + (target[j] in kept[j])
    return got


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--corpus", nargs="+", required=True, help="generated corpus folders (their heldout.txt)")
    ap.add_argument("--head", default=SHIPPED_FILE)
    ap.add_argument("--documents", type=int, default=12, help="held-out documents of each kind")
    ap.add_argument("--depth", type=int, default=3, help="the deepest chain drafted")
    args = ap.parse_args()
    torch.set_num_threads(2)
    llm = eecore.LLM(dtype="float32", device="cpu", quantization="none")
    head = FeatureHead.load(args.head, llm.model)
    trainer = FeatureHeadTrainer(llm, FeatureHeadConfig(drafts=args.depth), head.vocab, head=head)
    D = args.depth
    for kind, docs in sorted(documents_by_kind(llm.tokenizer, args.corpus, args.documents).items()):
        shapes = [(label, depth, width, False) for label, depth, width in FIXED] + \
                 [(label, depth, nodes, True) for label, depth, nodes in LIKELIEST]
        shapes = [s for s in shapes if s[1] <= D]
        emitted, nodes, positions = [0] * len(shapes), [0] * len(shapes), 0
        with torch.no_grad():
            for pos, state, token, greedy, _ in unrolls(trainer, docs, D):
                keys, probs, tokens = None, [], []
                for _ in range(D):
                    state, logits, keys = head.step(state, trainer.embed[token], trainer.head_rows, keys)
                    p, columns = logits.softmax(-1).topk(CANDIDATES, dim=-1)
                    probs.append(p)
                    tokens.append(columns if head.vocab is None else head.vocab[columns])
                    token = tokens[-1][:, 0]
                probs, tokens = torch.stack(probs, 1).tolist(), torch.stack(tokens, 1).tolist()  # [P][D][C]
                targets = torch.stack([greedy[pos + 1 + j] for j in range(D)], 1).tolist()
                positions += len(targets)
                for i, (p, t, target) in enumerate(zip(probs, tokens, targets)):
                    chain = [t[j][0] for j in range(D)]
                    for s, (_, depth, size, likeliest) in enumerate(shapes):
                        if likeliest:
                            keep, kept = most_likely_nodes(chain[:depth], [t[j][1:] for j in range(depth)],
                                                           p[:depth], size)
                        else:
                            keep, kept = depth, [t[j][1:size] for j in range(depth)]
                        emitted[s] += 1 + tree_yield(keep, kept, chain, target)
                        nodes[s] += keep + sum(map(len, kept))
        print(f"{kind} ({positions} positions):")
        for s, (label, *_rest) in enumerate(shapes):
            print(f"  {label:32s} {emitted[s] / positions:.3f} tokens a round, {nodes[s] / positions:.2f} nodes")


if __name__ == "__main__":
    main()
