"""The early-exit decode iteration: the seed paper's Algorithm 1, batched and paged.

One iteration decodes one token for every running sequence:
1. embed, then run the layers one at a time, writing each layer's K/V for the rows in flight;
2. at each checked exit layer E, measure every row's confidence on the residual stream after
   layer E-1 and fold it into the sticky per-row status with `accept_update` (the single scalar
   `remaining` is the only host sync of the check);
3. batch rule "all" (the paper's): when no row remains unconfident, the whole batch exits at E;
   batch rule "compact": confident rows leave at their own layer and the others go on as a
   smaller batch;
4. one `kv_fill` writes the K/V of the skipped layers of every exited row from its exit hidden
   state (per-row start layers), then the final norm and LM head make the logits.

Exit layers count layers that ran (E means layers 0..E-1; L is full depth).

Mixed steps (static exits and rule "all"): prefill chunks ride in the iteration as the last rows.
Every row runs the layers together until the decode rows exit; the chunks then go on alone through
the remaining layers (their K/V must be full depth). Confidence is measured on the decode rows
only, so a decode row exits where it would have without the chunks. Rule "compact" (rows leave one
by one) keeps one-kind steps.
"""
from __future__ import annotations

from typing import Optional

import torch

from eecore import ops
from eecore.engine.decoding import DecodeStrategy, Token
from eecore.engine.inputs import Row
from eecore.engine.runner import ModelRunner
from eecore.engine.sampler import Sampler
from eecore.engine.sequence import Sequence
from eecore.exits.agreement import LayerAgreement
from eecore.exits.agreement import load_for as load_decisions
from eecore.exits.classifier import ExitClassifier
from eecore.exits.confidence import (AdapterSoftmaxGap, ClassifierConfidence, ConfidenceMeasure, HiddenCosine,
                                     SoftmaxGap)
from eecore.exits.config import EarlyExitConfig
from eecore.exits.static_segments import StaticExitSegments
from eecore.exits.thresholds import ThresholdSchedule
from eecore.models.exit_adapter import DraftHead, ExitAdapters
from eecore.models.llama import AttentionInputs


def build_measure(config: EarlyExitConfig, runner: ModelRunner, max_rows: int,
                  draft_heads: Optional[dict] = None, adapters: Optional[ExitAdapters] = None
                  ) -> Optional[ConfidenceMeasure]:
    model = runner.model
    if config.measure == "static":
        return None
    if config.measure == "agreement":
        decisions = load_decisions(config.decision_path, model, adapters)
        if draft_heads:  # with exit adapters only their layers are checked
            decisions = {E: d for E, d in decisions.items() if E in draft_heads}
        return LayerAgreement(model, decisions, draft_heads or {}, max_rows)
    if config.measure == "softmax":
        return AdapterSoftmaxGap(draft_heads) if draft_heads else SoftmaxGap(model, max_rows)
    if config.measure == "cosine":
        return HiddenCosine()
    classifier = ExitClassifier.load(config.classifier_path, model.config.hidden_size, model.num_layers, model.dtype)
    return ClassifierConfidence(model, classifier, max_rows)


def checked_layers(config: EarlyExitConfig, measure: Optional[ConfidenceMeasure], num_layers: int,
                   draft_heads: Optional[dict] = None) -> list[int]:
    """Exit layers E (1..L-1) at which confidence is measured: with exit adapters, only theirs."""
    if measure is None:
        return []
    return [e for e in range(config.min_exit_layer, num_layers, config.check_every)
            if measure.available_at(e) and (not draft_heads or e in draft_heads)]


class EarlyExitDecoder(DecodeStrategy):
    """`adapters` (eecore.models.exit_adapter.ExitAdapters): a row that exits at a layer with an
    exit adapter reads its token through it (and the draft vocabulary); with adapter blocks, only
    their layers are checked, and the softmax measure reads through them too. The skipped layers'
    K/V still come from the exit hidden state itself, the residual stream those layers read."""

    def __init__(self, runner: ModelRunner, sampler: Sampler, config: EarlyExitConfig,
                 adapters: Optional[ExitAdapters] = None):
        super().__init__(runner, sampler)
        model = runner.model
        rows = runner.max_seqs
        dev = model.device
        self.config = config
        self.draft_heads = {} if adapters is None else \
            {E: DraftHead(model, E, adapters, rows) for E in adapters.exit_layers()}
        self.measure = build_measure(config, runner, rows, self.draft_heads, adapters)
        self.checks = frozenset(checked_layers(config, self.measure, self.num_layers, self.draft_heads))
        self.thresholds = ThresholdSchedule(config, self.num_layers, rows, dev)
        d = model.config.hidden_size
        self._status = torch.zeros(rows, dtype=torch.bool, device=dev)
        self._active = torch.ones(rows, dtype=torch.bool, device=dev)
        self._wasted = torch.zeros(rows, dtype=torch.int32, device=dev)
        self._exit_layer = torch.empty(rows, dtype=torch.int32, device=dev)
        self._exit_hidden = torch.empty(rows, d, dtype=model.dtype, device=dev)
        self._exit_top1 = torch.empty(rows, dtype=torch.int64, device=dev)
        self._previous = torch.empty(rows, d, dtype=model.dtype, device=dev) \
            if self.measure is not None and self.measure.needs_previous_hidden else None
        self._row_offsets = torch.arange(rows + 1, dtype=torch.int32, device=dev)
        self._tail_offsets = torch.empty(rows + 1, dtype=torch.int32, device=dev)
        self.supports_mixed_steps = self.measure is None or config.batch_rule == "all"
        # decode iterations as CUDA graphs of their segments wherever the decode steps are graphs
        # (rule "compact" changes the batch's shape mid-iteration: it stays eager)
        self.static = None
        if runner.graph_capture is not None and (self.measure is None or config.batch_rule == "all"):
            self.static = StaticExitSegments(self, rows, capture=runner.graph_capture)

    # ---- the iteration ---------------------------------------------------------------------
    def decode(self, seqs: list[Sequence]) -> list[list[Token]]:
        B, L = len(seqs), self.num_layers
        rows = [Row(s, s.num_computed_tokens, [s.last_token_id]) for s in seqs]
        if self.static is not None and self.static.takes(rows):
            return self._decode_static(seqs, rows)
        inputs = self.runner.prepare(rows)
        hidden = self.runner.embed(inputs)
        for s in seqs:
            s.num_computed_tokens += 1
        exit_layer = self._exit_layer[:B].fill_(L)
        if self.measure is None:
            exit_hidden = self._run_static(hidden, inputs.attn, exit_layer)
        elif self.config.batch_rule == "all":
            self._run_all_rule(seqs, hidden, inputs.attn, exit_layer)
            exit_hidden = hidden
        else:
            exit_hidden = self._run_compact_rule(seqs, hidden, inputs.attn, exit_layer)

        return self._finish(seqs, inputs.attn, exit_hidden, exit_layer)

    def _finish(self, seqs, attn: AttentionInputs, exit_hidden: torch.Tensor, exit_layer: torch.Tensor,
                exit_layers: Optional[list[int]] = None, logits: Optional[torch.Tensor] = None):
        """The skipped layers' K/V, from each row's exit hidden state, then the tokens.
        `exit_layers`: `exit_layer` as the host already knows it (else read from the device);
        `logits`: every row's at its exit, where a graph computed them."""
        B = len(seqs)
        if exit_layers is None:
            exit_layers = exit_layer.tolist()
        if min(exit_layers) < self.num_layers:
            self.runner.fill_kv(exit_hidden, attn.positions[:B], attn.slot_mapping[:B], exit_layer)
        tokens, logprobs = self._tokens(seqs, exit_hidden, exit_layers, logits)
        return [[Token(t, e, lp)] for t, e, lp in zip(tokens, exit_layers, logprobs)]

    def _decode_static(self, seqs, rows) -> list[list[Token]]:
        """The iteration as static segments (CUDA graphs on a GPU: eecore.exits.static_segments)."""
        B = len(seqs)
        inputs, hidden, ran, top1, logits = self.static.run(seqs, rows)
        for s in seqs:
            s.num_computed_tokens += 1
        exit_layer = self._exit_layer[:B].fill_(ran)
        self._top1_valid = top1 is not None and self.measure.gives_top1
        if self._top1_valid:
            self._exit_top1[:B].copy_(top1[:B])
        tokens = self._finish(seqs, inputs.attn, hidden, exit_layer, [ran] * B, logits)
        if self.measure is not None:  # after sampling has waited for the GPU: no extra sync
            self._record_wasted(seqs, self._wasted[:B])
        return tokens

    def _record_wasted(self, seqs, wasted: torch.Tensor) -> None:
        for seq, w in zip(seqs, wasted.tolist()):
            seq.stats["ee_wasted_layers"] += w
            seq.stats["ee_tokens"] += 1

    def _run_static(self, hidden, attn, exit_layer):
        E = self.config.exit_layer
        self.runner.run_layers(hidden, attn, 0, E)
        exit_layer.fill_(E)
        return hidden

    def _run_all_rule(self, seqs, hidden, attn, exit_layer) -> int:
        """The seed's rule: rows stay in the batch until every row is confident. The first
        len(seqs) rows of `hidden` are the decode rows (any rows after them are prefill chunks of a
        mixed step, which run along and are never measured). Returns the layers that ran."""
        B = len(seqs)
        status, active, wasted = self._status[:B].zero_(), self._active[:B], self._wasted[:B].zero_()
        self.thresholds.start_iteration(seqs)
        self.measure.start_iteration(seqs)
        self._top1_valid = False
        ran = self.num_layers
        for E in range(1, self.num_layers + 1):
            wasted += status  # rows already confident run this layer for nothing
            previous = self._remember(hidden[:B], E)
            self.runner.run_layers(hidden, attn, E - 1, E)
            if E in self.checks:
                confidence = self.measure(E, hidden[:B], previous)
                remaining = ops.accept_update(status, confidence, self.thresholds.at(E), active)
                if int(remaining) == 0:
                    exit_layer.fill_(E)
                    self._keep_top1(torch.arange(B, device=hidden.device), slice(None))
                    ran = E
                    break
        self._record_wasted(seqs, wasted)
        return ran

    # ---- mixed steps -----------------------------------------------------------------------
    def decode_mixed(self, seqs: list[Sequence], prefill_rows: list[Row]
                     ) -> tuple[list[list[Token]], list[Optional[Token]]]:
        B, L = len(seqs), self.num_layers
        rows = [Row(s, s.num_computed_tokens, [s.last_token_id]) for s in seqs] + prefill_rows
        inputs = self.runner.prepare(rows)
        hidden = self.runner.embed(inputs)
        attn = inputs.attn
        exit_layer = self._exit_layer[:B].fill_(L)
        if self.measure is None:
            self._run_static(hidden, attn, exit_layer)
            ran = self.config.exit_layer
        else:
            ran = self._run_all_rule(seqs, hidden, attn, exit_layer)
        if ran < L:  # the chunks, the last rows, go on alone (in place: the decode rows keep their state)
            self.runner.run_layers(hidden[B:], self._tail_rows(attn, B, max(len(r.tokens) for r in prefill_rows)),
                                   ran, L)
        for row in rows:
            row.seq.num_computed_tokens = row.start + len(row.tokens)
        exit_layers = exit_layer.tolist()
        if ran < L:
            self.runner.fill_kv(hidden[:B], attn.positions[:B], attn.slot_mapping[:B], exit_layer)
        tokens, logprobs = self._tokens(seqs, hidden[:B], exit_layers)
        decoded = [[Token(t, e, lp)] for t, e, lp in zip(tokens, exit_layers, logprobs)]
        # chunks that complete their prompt: the first output token, from full depth
        done = [j for j, r in enumerate(prefill_rows) if not r.seq.in_prefill]
        firsts: list[Optional[Token]] = [None] * len(prefill_rows)
        if done:
            last = inputs.last_rows[[B + j for j in done]]
            sampled, lps = self.sampler.sample(self.runner.logits(hidden.index_select(0, last)),
                                               [prefill_rows[j].seq for j in done])
            for j, t, lp in zip(done, sampled, lps):
                firsts[j] = Token(t, L, lp)
        return decoded, firsts

    def _tail_rows(self, attn: AttentionInputs, first: int, max_query_len: int) -> AttentionInputs:
        """The attention inputs of rows first.. (the prefill chunks of a mixed step). The decode
        rows before them have one token each, so the chunks' tokens start at row `first`."""
        n = attn.seq_lens.shape[0] - first
        offsets = torch.sub(attn.query_start_loc[first:], first, out=self._tail_offsets[: n + 1])
        cross = attn.cross_block_table is not None  # encoder-decoder: the rows' cross-attention blocks too
        return AttentionInputs(
            positions=attn.positions[first:], slot_mapping=attn.slot_mapping[first:],
            block_table=attn.block_table[first:], seq_lens=attn.seq_lens[first:], query_start_loc=offsets,
            max_query_len=max_query_len,
            cross_block_table=attn.cross_block_table[first:] if cross else None,
            cross_seq_lens=attn.cross_seq_lens[first:] if cross else None)

    def _run_compact_rule(self, seqs, hidden, attn, exit_layer):
        """Confident rows leave at their own layer; the rest continue as a compacted batch."""
        B = len(seqs)
        exit_hidden = self._exit_hidden[:B]
        rows = torch.arange(B, device=hidden.device)  # original index of each row in flight
        status, active = self._status[:B].zero_(), self._active[:B]
        self.thresholds.start_iteration(seqs)
        self.measure.start_iteration(seqs)
        self._top1_valid = False
        for E in range(1, self.num_layers + 1):
            previous = self._remember(hidden, E)
            self.runner.run_layers(hidden, attn, E - 1, E)
            if E not in self.checks:
                continue
            n = rows.shape[0]
            confidence = self.measure(E, hidden, previous)
            remaining = int(ops.accept_update(status[:n], confidence, self.thresholds.at(E), active[:n]))
            if remaining == n:
                continue
            leaving = status[:n].nonzero().squeeze(1)
            exit_hidden.index_copy_(0, rows[leaving], hidden.index_select(0, leaving))
            exit_layer.index_fill_(0, rows[leaving], E)
            self._keep_top1(rows[leaving], leaving)
            if remaining == 0:
                return exit_hidden
            staying = (~status[:n]).nonzero().squeeze(1)
            rows, hidden, attn = rows[staying], hidden.index_select(0, staying), self._rows_of(attn, staying)
            self.thresholds.keep_rows(staying)
            self.measure.keep_rows(staying)
            status[:remaining].zero_()
        exit_hidden.index_copy_(0, rows, hidden)  # rows that ran every layer
        return exit_hidden

    # ---- helpers ---------------------------------------------------------------------------
    def _remember(self, hidden: torch.Tensor, exit_layer: int) -> Optional[torch.Tensor]:
        """The stream before layer E-1, for measures that compare it with the one after."""
        if self._previous is None or exit_layer not in self.checks:
            return None
        return self._previous[: hidden.shape[0]].copy_(hidden)

    def _keep_top1(self, rows: torch.Tensor, leaving) -> None:
        """Remember the softmax check's top-1 of exiting rows: their greedy token, for free."""
        if self.measure.gives_top1:
            self._exit_top1.index_copy_(0, rows, self.measure.top1[leaving])
            self._top1_valid = True

    def _rows_of(self, attn: AttentionInputs, keep: torch.Tensor) -> AttentionInputs:
        """The attention inputs of a subset of decode rows (one query token per row)."""
        cross = attn.cross_block_table is not None  # encoder-decoder: the rows' cross-attention blocks too
        return AttentionInputs(
            positions=attn.positions.index_select(0, keep), slot_mapping=attn.slot_mapping.index_select(0, keep),
            block_table=attn.block_table.index_select(0, keep), seq_lens=attn.seq_lens.index_select(0, keep),
            query_start_loc=self._row_offsets[: keep.shape[0] + 1], max_query_len=1,
            cross_block_table=attn.cross_block_table.index_select(0, keep) if cross else None,
            cross_seq_lens=attn.cross_seq_lens.index_select(0, keep) if cross else None)

    def _tokens(self, seqs, exit_hidden, exit_layers, all_logits: Optional[torch.Tensor] = None):
        """Greedy rows that exited at a softmax check reuse its top-1; the others need logits
        (`all_logits`: every row's, already computed)."""
        L = self.num_layers
        reuse = [self._top1_valid and e < L and s.params.greedy and s.params.logprobs is None
                 for s, e in zip(seqs, exit_layers)] if self.measure is not None else [False] * len(seqs)
        tokens: list = [None] * len(seqs)
        logprobs: list = [None] * len(seqs)
        if any(reuse):
            top1 = self._exit_top1[: len(seqs)].tolist()
            for i, r in enumerate(reuse):
                if r:
                    tokens[i] = top1[i]
        need = [i for i, r in enumerate(reuse) if not r]
        # rows read their logits through the exit adapter of their exit layer, if it has one
        heads = sorted({self._head_layer(exit_layers[i]) for i in need}, key=lambda e: -1 if e is None else e)
        for head in heads:
            group = [i for i in need if self._head_layer(exit_layers[i]) == head]
            if head is None and all_logits is not None:
                logits = all_logits if len(group) == len(seqs) else \
                    all_logits.index_select(0, torch.tensor(group, device=all_logits.device))
            else:
                rows = exit_hidden if len(group) == len(seqs) else \
                    exit_hidden.index_select(0, torch.tensor(group, device=exit_hidden.device))
                logits = self.runner.logits(rows) if head is None else self.draft_heads[head].logits(rows)
            sampled, lps = self.sampler.sample(logits, [seqs[i] for i in group])
            for i, t, lp in zip(group, sampled, lps):
                tokens[i], logprobs[i] = t, lp
        return tokens, logprobs

    def _head_layer(self, exit_layer: int) -> Optional[int]:
        return exit_layer if exit_layer in self.draft_heads else None

    def release(self, seq: Sequence) -> None:
        if self.measure is not None:
            self.measure.release(seq)

    def metrics(self, seq: Sequence) -> dict[str, float]:
        n = seq.stats["ee_tokens"]
        if self.config.batch_rule != "all" or not n:
            return {}
        return {"layers_wasted_per_token": seq.stats["ee_wasted_layers"] / n}
