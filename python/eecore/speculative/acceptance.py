"""Accepting a round's drafts against the verify pass: the longest prefix the full model agrees with
plus its own next token (greedy, over a token tree when there are alternatives), or speculative
rejection sampling when sampling (over a token tree too), so the output law is the full model's (a
lookup draft is a deterministic proposal: q is one-hot; eecore.speculative.rejection). Rejected positions are rolled
back by advancing the sequence less (their K/V is simply overwritten later); an accepted tree
alternative's K/V moves from its leaf slot to the position it now holds."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch

from eecore.engine.decoding import Token
from eecore.engine.sampler import Sampler, argmax_rows, logprobs_rows
from eecore.engine.sequence import Sequence
from eecore.engine.transfer import device_tensor
from eecore.speculative.draft import Draft
from eecore.speculative.rejection import rejection_sample
from eecore.speculative.token_tree import accept_greedy


@dataclass
class Accepted:
    tokens: list[Token]        # the round's new tokens: leading exits, accepted drafts, the model's own
    drafts_accepted: int       # leading drafts kept (exits included)
    alternative_accepted: bool
    last_row: int              # the verify row (of this sequence) whose output is the last new token


class Acceptor:
    def __init__(self, runner, sampler: Sampler, num_layers: int, exit_layer, draft_stack=None):
        self.runner = runner
        self.sampler = sampler
        self.num_layers = num_layers
        self.exit_layer = exit_layer
        self.draft_stack = draft_stack
        # Benchmarks only (eecore.testing.accept_every_draft): a greedy chain is accepted whole,
        # whatever the verify pass says, so a round costs what it costs when every draft is right.
        # The output is then the drafts' text, not the model's.
        self.accepts_every_draft = False

    def accept_all(self, seqs: list[Sequence], drafts: list[Draft], widths: list[int],
                   logits: torch.Tensor) -> tuple[list[Accepted], list[int]]:
        """Accepts each sequence's draft against its rows of the verify pass's `logits` (`widths[b]`
        rows each, less its leading exits), advances it, and settles the copy's cache where the copy
        ran; returns what each accepted and each sequence's first logits row."""
        out, offsets, offset, moves = [], [], 0, []
        # every greedy row's full-depth token in one op (per sequence, each op would cost tens of
        # microseconds here, right after the verify pass)
        top = argmax_rows(logits).tolist() if any(seq.params.greedy for seq in seqs) else None
        L = self.num_layers
        for seq, draft, n in zip(seqs, drafts, widths):
            params, k = seq.params, len(draft.exits)
            if params.greedy and params.logprobs is None and not k and not draft.alternatives:
                # a greedy chain (a batch's usual row): its longest prefix equal to full depth's
                # tokens, then full depth's own, without _accept's per-sequence verdict objects
                chain, target, agreed = draft.tokens, top[offset: offset + n], 0
                if self.accepts_every_draft:
                    agreed = len(chain)
                    target = chain + target[agreed: agreed + 1]
                while agreed < len(chain) and chain[agreed] == target[agreed]:
                    agreed += 1
                tokens, leaf = [Token(t, L) for t in target[: agreed + 1]], -1
            else:
                # LayerDrafts.exit_threshold: the leading exits are emitted as they are (at layer E;
                # their logprobs are the exit's), and only the rows after them are accepted as usual
                n -= k
                # (a greedy row without logprobs reads only its argmax: no view of the logits, which
                # costs the host about a microsecond a sequence)
                rows = logits[offset: offset + n] if not params.greedy or params.logprobs is not None else None
                chain, probs, alternatives = (draft.tokens[k:], draft.probs[k:], draft.alternatives[k:]) if k else \
                    (draft.tokens, draft.probs, draft.alternatives)
                tokens, leaf, agreed = self._accept(seq, chain, probs, rows, alternatives,
                                                    None if top is None else top[offset: offset + n])
                if k:
                    tokens = [Token(t, self.exit_layer, lp) for t, lp in zip(draft.tokens[:k], draft.exits)] + tokens
                    agreed += k
                    if leaf >= 0:  # (trees and exits never meet: DraftCopy.top_k > 1 is refused with them)
                        leaf += k
            offsets.append(offset)
            offset += n
            start = seq.num_computed_tokens
            if leaf >= 0:  # an accepted alternative: its K/V moves from its leaf slot to its position
                moves.append((seq, start + leaf, start + agreed + 1))
            # positions up to the last accepted draft now hold valid K/V in every layer
            seq.num_computed_tokens += len(tokens)
            if draft.copy_ran:
                # the copy's K/V is right through the last chain draft the model agreed with
                self.draft_stack.settle(seq, start + agreed + 1)
            out.append(Accepted(tokens, len(tokens) - 1, leaf >= 0, leaf if leaf >= 0 else len(tokens) - 1))
        if moves:
            self._move_kv(moves)
        return out, offsets

    def _accept(self, seq: Sequence, drafts: list[int], draft_probs, logits: Optional[torch.Tensor],
                alternatives: list[list[int]], top) -> tuple[list[Token], int, int]:
        """The tokens this round adds (accepted drafts, then the full model's own token), the
        verify row of an accepted alternative (-1: none), and how many chain drafts the model
        agreed with. `top`: the argmax of each row of `logits` (greedy sequences)."""
        L, k = self.num_layers, seq.params.logprobs
        if seq.params.greedy:
            verdict = accept_greedy(drafts, alternatives, top)
        else:
            p = Sampler.probabilities(logits, [seq.params] * logits.shape[0])
            verdict = rejection_sample(drafts, draft_probs, p, self.sampler.generator_for(seq), alternatives,
                                       draw_row=lambda row: self.sampler.draw_own(logits[row: row + 1], seq))
        tokens, rows, leaf, agreed = verdict.tokens, verdict.rows, verdict.leaf_row, verdict.chain_accepted
        if k is None:
            return [Token(t, L) for t in tokens], leaf, agreed
        # every new token's log-probabilities in one pass over its rows (one read-back on a GPU)
        lps = logprobs_rows(logits.index_select(0, device_tensor(rows, logits.device)), tokens, [k] * len(tokens))
        return [Token(t, L, lp) for t, lp in zip(tokens, lps)], leaf, agreed

    def _move_kv(self, moves: list[tuple[Sequence, int, int]]) -> None:
        """Every layer's K/V of accepted alternatives, from their leaf slots to their positions."""
        bs = self.runner.block_size

        def slot(seq, pos):
            return seq.block_table[pos // bs] * bs + pos % bs

        device = self.runner.device
        src = torch.tensor([slot(seq, a) for seq, a, _ in moves], dtype=torch.int64, device=device)
        dst = torch.tensor([slot(seq, b) for seq, _, b in moves], dtype=torch.int64, device=device)
        self.runner.copy_kv_slots(src, dst)
