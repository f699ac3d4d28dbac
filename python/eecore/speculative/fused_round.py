"""A self-speculation round with one host round trip (`LLM(fused_rounds=True)`): a draft copy's
greedy round, its passes launched back to back from tokens on the device, acceptance decided on
the device, one read-back.

The op-by-op round (eecore.speculative.decoder) builds every pass when it launches it, reads each
draft back to decide the next pass, and accepts on the host: on a GPU each of those waits stalls
the GPU until the host has caught up, and the host's share of a round (bench/cost_host.py
--speculate) is about seven plain steps' for three to five tokens. Here, for a round of d drafts
over B sequences:

1. one fill of every pass's inputs (eecore.speculative.round_inputs: positions, slots, block
   tables of the copy's d passes and the verify pass), one copy to the device;
2. the copy's passes (DraftChain): pass 0 runs the token before the pending one and the pending one,
   pass k draft k; each ends with the draft head and writes its argmax token into the round's
   drafts buffer, which the next pass reads;
3. the verify pass (VerifyAndAccept): every layer over the pending token and the d drafts of each
   sequence, then on the device the model's argmax of each row and the number of leading drafts it
   agrees with;
4. one read-back of those W + 1 numbers a sequence; the host appends the tokens and keeps the
   books (the copy's cache, the metrics, the planner's rates and clock).

On a GPU each pass is a CUDA graph per padded batch size (the StaticPass machinery), its picking
and acceptance inside the graph. What it gives up: the chain is not cut where a draft is doubtful
(`stop_below`, `long_draft_acceptance`): every sequence verifies d drafts, since the passes run
for the batch anyway and greedy acceptance keeps the model's tokens whatever was drafted; the
planner still chooses d per round (the largest length it plans for any sequence; 0: a plain step).

It takes the rounds that need nothing else: greedy sequences without log-probabilities, layer
drafts from a draft copy with no token trees, exits or prompt lookup, no acceptance guard, every
sequence's copy at most one token behind (the first round after a prompt catches the copy up op by
op) and the context's room for W positions. Any other round runs op by op, with the same tokens.
"""
from __future__ import annotations

import time
from typing import Optional

import torch

from eecore.engine.static_pass import StaticPass
from eecore.speculative.round_inputs import RoundInputs


class DraftChain(StaticPass):
    """The draft copy's passes of a fused round (on the copy's runner), each ending with its draft
    head's argmax token written into `drafts[k + 1]`."""

    def __init__(self, stack, max_batch: int, capture: bool, drafts: torch.Tensor):
        super().__init__(stack.runner, max_batch, capture)
        self.head = stack.head
        self.num_layers = stack.exit_layer
        self.drafts = drafts
        dev = drafts.device
        self._last = torch.empty(max_batch, stack.model.config.hidden_size, dtype=stack.model.dtype, device=dev)
        self._columns = torch.empty(max_batch, dtype=torch.int64, device=dev)

    def launch(self, k: int, inputs, key: tuple) -> None:
        self._launch(key + (k,), inputs, lambda i: self.step(i, k))

    def step(self, inputs, k: int) -> torch.Tensor:
        runner = self.runner
        P = inputs.last_rows.shape[0]
        hidden = runner.run_layers(runner.embed(inputs), inputs.attn, 0, self.num_layers, count=False)
        if k == 0:  # two tokens a row: the pending one (each row's last) drafts; it is the verify pass's first
            hidden = torch.index_select(hidden, 0, inputs.last_rows, out=self._last[:P])
            self.drafts[0, :P].copy_(inputs.token_ids.view(P, 2)[:, 1])
        columns = torch.argmax(self.head.columns(hidden), dim=-1, out=self._columns[:P])
        return self.drafts[k + 1, :P].copy_(self.head.token_ids(columns))


class VerifyAndAccept(StaticPass):
    """The verify pass of a fused round (on the model's runner) and its acceptance: `result[b]` is
    row b's W argmax tokens, then how many leading drafts they agree with."""

    def __init__(self, runner, max_batch: int, capture: bool, drafts: torch.Tensor, verify_tokens: torch.Tensor):
        super().__init__(runner, max_batch, capture)
        self.drafts, self.verify_tokens = drafts, verify_tokens
        most, dev = drafts.shape[0], drafts.device
        self.result = torch.empty(max_batch, most + 1, dtype=torch.int64, device=dev)
        self._target = torch.empty(max_batch * most, dtype=torch.int64, device=dev)
        self._agree = torch.empty(max_batch, most - 1, dtype=torch.bool, device=dev)
        self._run = torch.empty(max_batch, most - 1, dtype=torch.int64, device=dev)
        # eecore.testing.accept_every_draft: every draft accepted (benchmarks: a round's cost with
        # perfect drafts); read when a pass is recorded
        self.accepts_every_draft = False

    def launch(self, W: int, inputs, key: tuple) -> torch.Tensor:
        return self._launch(key + (W,), inputs, lambda i: self.step(i, W))

    def step(self, inputs, W: int) -> torch.Tensor:
        runner = self.runner
        P, d = inputs.last_rows.shape[0], W - 1
        inputs.token_ids.view(P, W).copy_(self.drafts[:W, :P].t())
        hidden = runner.run_layers(runner.embed(inputs), inputs.attn, 0, runner.num_layers, count=False)
        target = torch.argmax(runner.logits(hidden), dim=-1, out=self._target[: P * W]).view(P, W)
        result = self.result[:P, : W + 1]
        drafted = self.drafts[1:W, :P].t()
        if self.accepts_every_draft:
            result[:, :d].copy_(drafted)
            result[:, d].copy_(target[:, d])
            result[:, W].fill_(d)
            return result
        result[:, :W].copy_(target)
        agree = torch.eq(drafted, target[:, :d], out=self._agree[:P, :d])
        # the leading drafts the model agrees with: the sum of the running product of the matches
        torch.cumprod(agree, dim=1, out=self._run[:P, :d])
        torch.sum(self._run[:P, :d], dim=1, out=result[:, W])
        return result


class FusedRound:
    """A draft copy's greedy rounds with one host round trip (module doc)."""

    def __init__(self, runner, stack, max_drafts: int, capture: bool):
        max_batch, dev = runner.max_seqs, runner.device
        self.runner, self.stack, self.max_drafts = runner, stack, max_drafts
        self.drafts = torch.zeros(max_drafts + 1, max_batch, dtype=torch.int64, device=dev)
        self.verify_tokens = torch.zeros(max_batch * (max_drafts + 1), dtype=torch.int64, device=dev)
        self.inputs = RoundInputs(max_batch, max_drafts, runner.block_size, runner.max_blocks_per_seq,
                                  runner.kv.pad_block, self.drafts, self.verify_tokens, dev)
        self.chain = DraftChain(stack, max_batch, capture, self.drafts)
        self.verify = VerifyAndAccept(runner, max_batch, capture, self.drafts, self.verify_tokens)
        self._events = [torch.cuda.Event(enable_timing=True) for _ in range(2)] if dev.type == "cuda" else None
        self.rounds = 0  # fused rounds run (tests read it)

    @property
    def captures(self) -> int:
        """Graphs recorded and input layouts made so far: a round that did either paid a one-time
        cost, which the draft planner's clock must not learn from."""
        return self.chain.captures + self.verify.captures + self.inputs.layouts_made

    def survey(self, seqs) -> tuple[list[int], int]:
        """In one walk over `seqs`: the new tokens each may still get (max_tokens and the context
        both bound it), and the fewest positions any has left in the context, or -1 where one is
        not greedy or asks for log-probabilities (the round then runs op by op)."""
        longest = self.runner.max_model_len
        rooms, margin, fuses = [], longest, True
        for seq in seqs:
            params, left = seq.params, longest - seq.num_tokens
            rooms.append(min(params.max_tokens - seq.num_output_tokens, left))
            margin = min(margin, left)
            fuses = fuses and params.greedy and params.logprobs is None
        return rooms, margin if fuses else -1

    def takes(self, seqs, drafts: int, behinds, margin: int) -> bool:
        """Whether a fused round of `drafts` drafts can run `seqs` (module doc), `margin` their survey's.
        A sequence that may emit fewer tokens than the round's gets the ones it may (the engine's stop
        checks cut the rest), but its last position must lie within the context."""
        P = self.chain.padded_size(len(seqs)) if len(seqs) <= self.chain.max_batch else None
        return (P is not None and 0 < drafts <= min(self.max_drafts, margin)
                and P * (drafts + 1) <= self.runner.max_tokens and 2 * P <= self.stack.runner.max_tokens
                and max(behinds) <= 1)

    def run(self, seqs, drafts: int) -> Optional[tuple[list[list[int]], float]]:
        """The round: each sequence's row (its W argmax tokens, then the drafts accepted), and the
        seconds its copy passes took (on a GPU timed by events around them, which the read-back
        has waited for); None where its inputs do not fit (a row's blocks end before its last
        position)."""
        P = self.chain.padded_size(len(seqs))
        layout = self.inputs.fill(seqs, P, drafts)
        if layout is None:
            return None
        W, key = drafts + 1, (P, layout.table_width)
        events = self._events
        if events is not None:
            events[0].record()
        begin = time.perf_counter()
        self.chain.launch(0, layout.first, key)
        for k in range(1, drafts):
            self.chain.launch(k, layout.chain[k - 1], key)
        drafting = time.perf_counter() - begin
        if events is not None:
            events[1].record()
        result = self.verify.launch(W, layout.verify[W], key)
        rows = result[: len(seqs)].tolist()  # the round's one read-back
        if events is not None:
            drafting = events[0].elapsed_time(events[1]) / 1e3
        self._count(seqs, drafts)
        self.rounds += 1
        return rows, drafting

    def _count(self, seqs, drafts: int) -> None:
        """The real rows' work (tests prove with it that no work is repeated)."""
        n = len(seqs)
        copy_tokens, model_tokens = self.stack.runner.layer_tokens, self.runner.layer_tokens
        for i in range(self.stack.exit_layer):
            copy_tokens[i] += n * (drafts + 1)
        for i in range(self.runner.num_layers):
            model_tokens[i] += n * (drafts + 1)
