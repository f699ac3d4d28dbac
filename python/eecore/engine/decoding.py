"""What a decode step returns, and the full-depth decode step every other strategy builds on."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch

from eecore.engine.inputs import Row
from eecore.engine.runner import ModelRunner
from eecore.engine.sampler import Sampler
from eecore.engine.sequence import Sequence


@dataclass
class Token:
    token_id: int
    exit_layer: int                               # layers that ran for it (L is full depth)
    logprobs: Optional[dict[int, float]] = None


class DecodeStrategy:
    """One model iteration for every running sequence; returns the tokens each one gained.

    `lookahead` is how many KV slots past the pending token a step may write (1 here; d + 1 for
    self-speculation), so the scheduler reserves them.

    `supports_mixed_steps`: the strategy implements `decode_mixed`, one model pass that decodes
    the running sequences and computes prefill chunks of others beside them, so the scheduler may
    put both in one step. A strategy without it (early exit: rows leave the layer loop early;
    self-speculation: draft passes over the first E layers) gets steps of one kind only.

    `plain_above`: a strategy that looks ahead (lookahead > 1) but runs plain full-depth steps
    when more than this many sequences decode (None: never). The scheduler plans such a step with
    one slot per decode and may mix prompt chunks into it; the engine then calls `decode_plain`
    (or `decode_mixed`), and the strategy must decode one token per sequence there.
    """

    lookahead = 1
    supports_mixed_steps = False
    plain_above: Optional[int] = None

    def __init__(self, runner: ModelRunner, sampler: Sampler):
        self.runner = runner
        self.sampler = sampler
        self.num_layers = runner.num_layers

    def decode(self, seqs: list[Sequence]) -> list[list[Token]]:
        raise NotImplementedError

    def decode_plain(self, seqs: list[Sequence]) -> list[list[Token]]:
        """One token per sequence, at full depth (a step the scheduler planned without lookahead;
        see `plain_above`)."""
        return self.decode(seqs)

    def decode_mixed(self, seqs: list[Sequence], prefill_rows: list[Row]
                     ) -> tuple[list[list[Token]], list[Optional[Token]]]:
        """Decodes `seqs` and computes the prefill chunks `prefill_rows` in one pass: the decodes'
        tokens, and for each chunk the first output token if it completed its prefill, else None."""
        raise NotImplementedError(f"{type(self).__name__} does not support mixed steps")

    def release(self, seq: Sequence) -> None:
        """Drop any per-sequence state once `seq` finished."""

    def metrics(self, seq: Sequence) -> dict[str, float]:
        """Strategy-specific per-request metrics (merged into the output's metrics)."""
        return {}


class FullDepthDecoder(DecodeStrategy):
    supports_mixed_steps = True

    def decode(self, seqs: list[Sequence]) -> list[list[Token]]:
        return self.step(seqs)[0]

    def decode_mixed(self, seqs: list[Sequence], prefill_rows: list[Row]
                     ) -> tuple[list[list[Token]], list[Optional[Token]]]:
        if not prefill_rows:
            return self.decode(seqs), []
        # Decode rows first: one query token each, so row i's last token is at index i. The
        # varlen paged attention takes the chunks' longer query runs in the same call.
        rows = [Row(s, s.num_computed_tokens, [s.last_token_id]) for s in seqs] + prefill_rows
        inputs, hidden = self.runner.forward(rows)
        B = len(seqs)
        done = [B + j for j, r in enumerate(prefill_rows) if not r.seq.in_prefill]
        picked = list(range(B)) + done
        last = inputs.last_rows if len(picked) == len(rows) else inputs.last_rows[picked]
        logits = self.runner.logits(hidden.index_select(0, last))
        tokens, logprobs = self.sampler.sample(logits, [rows[i].seq for i in picked])
        out = [Token(t, self.num_layers, lp) for t, lp in zip(tokens, logprobs)]
        firsts: list[Optional[Token]] = [None] * len(prefill_rows)
        for i, token in zip(done, out[B:]):
            firsts[i - B] = token
        return [[t] for t in out[:B]], firsts

    def step(self, seqs: list[Sequence], tap=None) -> tuple[list[list[Token]], torch.Tensor]:
        """The step's tokens and its fp32 logits `[B, V]`; `tap` as in ModelRunner.forward. Without
        a tap the step runs static (a CUDA graph replay on a GPU) where the runner has one."""
        rows = [Row(s, s.num_computed_tokens, [s.last_token_id]) for s in seqs]
        static = self.runner.static_decode
        if tap is None and static is not None and static.takes(rows):
            _, logits = static.run(rows)
            static.prepare_next(rows)  # on a GPU, while the step's graph runs
        else:
            _, hidden = self.runner.forward(rows, tap)
            logits = self.runner.logits(hidden)
        tokens, logprobs = self.sampler.sample(logits, seqs)
        return [[Token(t, self.num_layers, lp)] for t, lp in zip(tokens, logprobs)], logits
