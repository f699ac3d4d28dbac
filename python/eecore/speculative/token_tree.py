"""Token trees for verification: the draft's top-1 chain plus alternatives at each position.

A layer draft of d tokens x_1..x_d is a chain: each draft pass continues from the previous draft.
Its draft distributions also name runners-up, which cost nothing to propose: the verify pass
checks them beside the chain, as leaves (`alternatives[i]` are siblings of x_{i+1}, children of
x_i, with x_0 the pending token). The verify row of a sequence is

    [x_0, x_1, ..., x_m, alternatives of depth 1, alternatives of depth 2, ...]

so the chain keeps the slots and positions a chain-only round gives it, and the leaves follow in
slots of their own (engine.inputs.Row.parents gives each its depth as position, and the attention
mask hides siblings from each other).

Greedy acceptance walks the chain while the model agrees with it; at the first disagreement, the
model's token may be one of that position's alternatives: it is accepted, and its own verify row
gives one more token. Its K/V then sits in a leaf's slot and moves to the position it now holds.
A sampled sequence's alternatives are more draws from the draft's distribution, accepted by
rejection sampling over the same layout (eecore.speculative.rejection).

Which nodes a greedy tree verifies can follow the drafter's own probabilities (`most_likely_nodes`,
as EAGLE-2's dynamic trees rank their nodes): a node's chance of being on the model's path is about
the product of the draft probabilities along it, so where the first position is doubtful its
runners-up are worth more rows than the chain's next token, and where it is sure the reverse. A
tree of d positions and k tokens each verifies d x k nodes; the same number, taken as the most
likely among the chain and k runners-up at each position, yields more.
"""
from __future__ import annotations

from dataclasses import dataclass

from eecore.engine.inputs import Row
from eecore.engine.sequence import Sequence


def tree_row(seq: Sequence, chain: list[int], alternatives: list[list[int]]) -> Row:
    """The verify row of a sequence's pending token, its chain of drafts and their alternatives
    (`alternatives[i]`: other candidates for chain[i]); a plain row when there are none."""
    tokens = [seq.last_token_id] + chain
    if not any(alternatives):
        return Row(seq, seq.num_computed_tokens, tokens)
    parents = list(range(-1, len(chain)))
    for depth, alts in enumerate(alternatives):
        tokens += alts
        parents += [depth] * len(alts)  # children of chain token `depth` (0: the pending token)
    return Row(seq, seq.num_computed_tokens, tokens, parents)


def most_likely_nodes(chain: list[int], alternatives: list[list[int]], probs: list[list[float]],
                      budget: int) -> tuple[int, list[list[int]]]:
    """The `budget` nodes of a greedy tree with the highest path probability: `probs[j]` are the draft
    probabilities of chain[j] and then of alternatives[j] (its runners-up, most likely first). A
    node's score is its own probability times its parents' (the chain tokens before it); a chain
    token scores at least each of its siblings and each of its descendants, so the best nodes form
    a tree: a prefix of the chain and some runners-up at each of its positions. Returns (how many
    chain tokens stay, the runners-up kept at each of those positions)."""
    nodes, reach = [], 1.0  # reach: the path probability up to the position's parent
    for j, p in enumerate(probs[: len(chain)]):
        for r, q in enumerate(p[: 1 + len(alternatives[j])]):
            # ties go to the chain token, then to the shallower, then to the likelier runner-up
            nodes.append((reach * q, r == 0, -j, -r))
        reach *= p[0]
    chosen = sorted(nodes, reverse=True)[:budget]
    chain_kept = {-j for _, is_chain, j, _ in chosen if is_chain}
    keep = 0
    while keep in chain_kept:
        keep += 1
    kept = [[] for _ in range(keep)]
    for _, is_chain, j, r in sorted(chosen, key=lambda n: (-n[2], -n[3])):
        if not is_chain and -j < keep:
            kept[-j].append(alternatives[-j][-r - 1])
    return keep, kept


@dataclass
class TreeAcceptance:
    tokens: list[int]      # the round's new tokens: accepted drafts, then the model's own
    rows: list[int]        # the verify row (of this sequence) whose logits predicted each token
    leaf_row: int = -1     # an accepted alternative's verify row (its K/V must move), or -1
    chain_accepted: int = 0


def accept_greedy(chain: list[int], alternatives: list[list[int]], target: list[int]) -> TreeAcceptance:
    """Greedy acceptance over a tree row (tree_row's layout); `target[r]` is the model's argmax
    after verify row r."""
    accepted = 0
    while accepted < len(chain) and chain[accepted] == target[accepted]:
        accepted += 1
    tokens, rows = chain[:accepted] + [target[accepted]], list(range(accepted + 1))
    if accepted < len(alternatives):
        leaf = 1 + len(chain) + sum(len(a) for a in alternatives[:accepted])
        alts = alternatives[accepted]
        if target[accepted] in alts:
            leaf += alts.index(target[accepted])
            return TreeAcceptance(tokens + [target[leaf]], rows + [leaf], leaf, accepted)
    return TreeAcceptance(tokens, rows, -1, accepted)
