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
