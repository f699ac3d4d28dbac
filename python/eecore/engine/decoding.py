"""What a decode step returns, and the full-depth decode step every other strategy builds on."""
from __future__ import annotations

from typing import Optional

import torch

from eecore import ops
from eecore.engine.inputs import Row
from eecore.engine.runner import ModelRunner
from eecore.engine.sampler import Sampler, argmax_rows, eecore_argmax_selected, logprob_dicts, logprob_tensors
from eecore.engine.sequence import Sequence
from eecore.engine.static_decode import AheadStep, decode_ahead_enabled
from eecore.engine.tokens import Token  # (strategies import it from here)
from eecore.engine.transfer import device_tensor


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

    def use_blocks(self, blocks) -> None:
        """The engine's BlockManager, for a strategy whose steps launch their successor ahead (it
        reserves the block a row's next position starts; FullDepthDecoder._reserve_next_blocks)."""

    def decode_plain(self, seqs: list[Sequence]) -> list[list[Token]]:
        """One token per sequence, at full depth (a step the scheduler planned without lookahead;
        see `plain_above`)."""
        return self.decode(seqs)

    def decode_mixed(self, seqs: list[Sequence], prefill_rows: list[Row]
                     ) -> tuple[list[list[Token]], list[Optional[Token]]]:
        """Decodes `seqs` and computes the prefill chunks `prefill_rows` in one pass: the decodes'
        tokens, and for each chunk the first output token if it completed its prefill, else None."""
        raise NotImplementedError(f"{type(self).__name__} does not support mixed steps")

    def prefill_tap(self, num_tokens: int):
        """What a prompt pass of `num_tokens` tokens should copy out on the way (a ModelRunner.forward
        tap), for `prefilled`; None: nothing (the default)."""
        return None

    def prefilled(self, seqs: list[Sequence], rows: list[int], tapped) -> None:
        """`seqs` finished their prompts in a pass that tapped `tapped` (prefill_tap's buffer); seqs[i]'s
        last prompt token is its row rows[i]."""

    def release(self, seq: Sequence) -> None:
        """Drop any per-sequence state once `seq` finished."""

    def metrics(self, seq: Sequence) -> dict[str, float]:
        """Strategy-specific per-request metrics (merged into the output's metrics)."""
        return {}


class FullDepthDecoder(DecodeStrategy):
    """Every layer for every token. On a GPU (and with `allow_ahead`; see decode_ahead_enabled), a
    decode step on static buffers launches the next step before reading its own tokens back (see
    `_decode_ahead`)."""

    supports_mixed_steps = True

    def __init__(self, runner: ModelRunner, sampler: Sampler):
        super().__init__(runner, sampler)
        # a strategy that runs plain steps between its own passes decides it step by step
        self.allow_ahead = True
        # the engine's BlockManager (use_blocks): a step launched ahead may give a row the block its
        # next position needs a step before the scheduler would
        self.blocks = None
        self._ahead: Optional[AheadStep] = None
        self._readback: Optional[TokenReadback] = None

    def decode(self, seqs: list[Sequence]) -> list[list[Token]]:
        if self.allow_ahead and decode_ahead_enabled(self.runner.model.device, self.runner.decode_ahead):
            tokens = self._decode_ahead(seqs)
            if tokens is not None:
                return tokens
        self._ahead = None
        return self.step(seqs)[0]

    def use_blocks(self, blocks) -> None:
        self.blocks = blocks

    def _decode_ahead(self, seqs: list[Sequence]) -> Optional[list[list[Token]]]:
        """A step on static buffers whose successor is launched before its tokens are read
        back: the argmax (sampled rows' draws written over it) puts the tokens on the device, the
        next step (the same sequences one position further) copies them into its inputs and runs,
        and the host waits for this step's tokens and log-probabilities only (queued for the host
        before the next step). The engine's next step takes that step's logits if its rows are the
        ones it ran (StaticDecode.take_ahead); otherwise it runs its own and the ahead step's work
        is lost. Sampled rows draw the same numbers from their generators as in a plain step; a
        top-p row's nucleus search reads the device before the launch, which then waits for it.
        None where the step is not one static decode step."""
        rows = [Row(s, s.num_computed_tokens, [s.last_token_id]) for s in seqs]
        static = self.runner.static_decode
        if static is None or not static.takes(rows):
            self._ahead = None
            return None
        ahead, self._ahead = self._ahead, None
        logits = None if ahead is None else static.take_ahead(ahead, rows)
        if logits is None:
            _, logits = static.run(rows)
        if self._readback is None:
            self._readback = TokenReadback(static.max_batch, logits.device)
        tokens = self._readback.argmax(logits)
        self.sampler.draw_sampled(logits, seqs, tokens)
        wanted = [i for i, s in enumerate(seqs) if s.params.logprobs is not None]
        ks = [seqs[i].params.logprobs for i in wanted]
        if wanted and len(wanted) < len(seqs):
            index = device_tensor(wanted, logits.device)
            self._readback.start(*logprob_tensors(logits.index_select(0, index), tokens.index_select(0, index), ks))
        else:
            self._readback.start(*(logprob_tensors(logits, tokens, ks) if wanted else ()))
        self._reserve_next_blocks(rows)
        self._ahead = static.launch_ahead(rows, tokens)
        token_list = self._readback.wait(len(rows))
        if self._ahead is not None:
            self._ahead.tokens = token_list
        logprobs: list[Optional[dict[int, float]]] = [None] * len(seqs)
        if wanted:
            values, ids, chosen = (t.tolist() for t in self._readback.extra)
            for i, d in zip(wanted, logprob_dicts(values, ids, chosen, [token_list[i] for i in wanted], ks)):
                logprobs[i] = d
        return [[Token(t, self.num_layers, lp)] for t, lp in zip(token_list, logprobs)]

    def decode_mixed(self, seqs: list[Sequence], prefill_rows: list[Row], tap=None
                     ) -> tuple[list[list[Token]], list[Optional[Token]]]:
        """`tap`: as ModelRunner.forward's (the decodes' tokens first, then the chunks')."""
        if not prefill_rows and tap is None:
            return self.decode(seqs), []
        # Decode rows first: one query token each, so row i's last token is at index i. The
        # varlen paged attention takes the chunks' longer query runs in the same call.
        rows = [Row(s, s.num_computed_tokens, [s.last_token_id]) for s in seqs] + prefill_rows
        inputs, hidden = self.runner.forward(rows, tap)
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

    def _reserve_next_blocks(self, rows: list[Row]) -> None:
        """The blocks the rows' next positions start, taken now so that the step after can be
        launched ahead (with blocks of 16, a batch of 64 has a row crossing into a new block nearly
        every step). Only from spare blocks: the scheduler must still find a block for every
        running sequence; a sequence that finishes or is preempted gives its block back with the
        rest."""
        if self.blocks is None:
            return
        bs = self.blocks.block_size
        short = [r for r in rows if (r.start + 1) // bs >= len(r.seq.block_table)]
        if short and self.blocks.num_free_blocks >= len(short) + len(rows):
            for row in short:
                self.blocks.grow(row.seq, row.start + 2)

    def step(self, seqs: list[Sequence], tap=None) -> tuple[list[list[Token]], torch.Tensor]:
        """The step's tokens and its fp32 logits `[B, V]`; `tap` as in ModelRunner.forward. The step
        runs static (a CUDA graph replay on a GPU) where the runner has one that takes its rows
        (and, with a tap, taps: StaticPass.takes_taps)."""
        rows = [Row(s, s.num_computed_tokens, [s.last_token_id]) for s in seqs]
        static = self.runner.static_decode
        if static is not None and (tap is None or static.takes_taps) and static.takes(rows):
            _, logits = static.run(rows, tap)
            static.prepare_next(rows)  # on a GPU, while the step's graph runs
        else:
            _, hidden = self.runner.forward(rows, tap)
            logits = self.runner.logits(hidden)
        tokens, logprobs = self.sampler.sample(logits, seqs)
        return [[Token(t, self.num_layers, lp)] for t, lp in zip(tokens, logprobs)], logits


class TokenReadback:
    """A decode step's tokens: the argmax into a static device buffer (sampled rows' draws written
    over it), then copied to pinned host memory behind it on the stream, with any other tensors the
    host needs from the step (log-probabilities), so the host can wait for them alone while later
    work (a step launched ahead) is queued behind. On the CPU, the argmax and a list."""

    def __init__(self, max_batch: int, device: torch.device):
        self.device = device
        self._tokens: Optional[torch.Tensor] = None
        self.extra: list[torch.Tensor] = []  # start's other tensors, on the host once wait returned
        if device.type == "cuda":
            self._values = torch.empty(max_batch, dtype=torch.float32, device=device)
            self._indices = torch.empty(max_batch, dtype=torch.int64, device=device)
            self._host = torch.empty(max_batch, dtype=torch.int64, pin_memory=True)
            self._copied = torch.cuda.Event()

    def argmax(self, logits: torch.Tensor) -> torch.Tensor:
        """Each row's argmax (sampler.argmax_rows' tie and NaN rules), `[B]` int64 on the device."""
        B = logits.shape[0]
        if self.device.type != "cuda":
            self._tokens = argmax_rows(logits).reshape(B)
        else:
            if eecore_argmax_selected():
                self._tokens = ops.argmax(logits, out=self._indices[:B])
            else:
                torch.max(logits, dim=-1, out=(self._values[:B], self._indices[:B]))
                self._tokens = self._indices[:B]
        return self._tokens

    def start(self, *extra: torch.Tensor) -> None:
        """Queues the copy to the host of the tokens and of `extra` (call before queueing work that
        should not be waited for)."""
        if self.device.type != "cuda":
            self.extra = list(extra)
            return
        B = self._tokens.shape[0]
        self._host[:B].copy_(self._tokens, non_blocking=True)
        self.extra = [torch.empty(t.shape, dtype=t.dtype, pin_memory=True).copy_(t, non_blocking=True) for t in extra]
        self._copied.record()

    def wait(self, count: int) -> list[int]:
        if self.device.type != "cuda":
            return self._tokens[:count].tolist()
        self._copied.synchronize()
        return self._host[:count].tolist()

