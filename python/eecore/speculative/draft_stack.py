"""Separate draft layers (`LayerDrafts(copy=DraftCopy())`): a copy of the model's
layers 0..E-1 that drafts with a KV cache of its own, while verification runs the model's L layers.

Why a copy, when LayerSkip shares the first E layers between draft and verification: a shared
layer is one weight for two jobs. Training it for its exit (eecore.train.exit_ready) moves what the
later layers receive, and full depth drifts from the original model. A copy can be trained (an
exit-ready file's LoRA pairs are merged into the copy alone) and stored in a cheaper dtype (bf16, or
8 bits: eecore.models.int8_weights.eight_bit), and full depth, hence every output, stays the
original model's. What it costs:
- verification cannot continue from the drafts' layer-E states (they come from other weights), so
  it runs all L layers over the drafted positions: d draft passes of E layers plus L layers per
  round, where the shared stack reads d + 1 passes of E layers plus L - E: the same bytes at equal
  dtype, fewer with a cheaper copy;
- the copy's K/V for E layers, in the same paged blocks as the model's (same block tables and
  slots), and its catching up on tokens it has not run: the prompt at a sequence's first
  layer-draft round (E/L of a prefill), and the tokens of rounds drafted by lookup or not at all.

Correctness never depends on the copy's cache: it feeds only drafts, which verification checks.
So the bookkeeping is simple: per sequence, the number of leading positions whose draft K/V are
known to be right, dropped to 0 when the sequence was preempted (its blocks were freed), and never
above the positions the model has verified. A new sequence starts from 0 even when the prefix
cache gave it computed blocks: the copy reruns its prompt (writing the same values into any shared
block).
"""
from __future__ import annotations

import dataclasses
from collections import deque
from typing import Optional

import torch

from eecore.engine.inputs import Row
from eecore.engine.kv_cache import KVCache
from eecore.engine.runner import ModelRunner
from eecore.engine.sequence import Sequence
from eecore.models.exit_adapter import DraftHead, ExitAdapters
from eecore.models.lora import LoraDeltas, layer_index
from eecore.speculative.guard import layer_weight_bytes
from eecore.speculative.state import SequenceStates
from eecore.speculative.static_passes import StaticLayers


def build_draft_model(loaded, exit_layer: int, lora: Optional[LoraDeltas], dtype: torch.dtype,
                      device: torch.device, source: str = "exit adapter", weight_dtype: Optional[torch.dtype] = None,
                      tp=None):
    """A LlamaModel of `loaded`'s layers 0..exit_layer-1 (and its embeddings, final norm and LM
    head, which the draft head reads), in `dtype`, with `lora`'s pairs for those layers merged in
    (pairs of later layers change nothing the drafts run, and are left out). `weight_dtype=torch.int8`
    makes its matrices 8-bit after the merge (eecore.models.int8_weights.eight_bit). `tp`: split over
    tensor-parallel ranks as the model is."""
    from eecore.models.llama import LlamaModel

    if not 1 <= exit_layer < loaded.config.num_layers:
        raise ValueError(f"separate draft layers: exit_layer must be in 1..{loaded.config.num_layers - 1}, "
                         f"got {exit_layer}")
    state = {k: v for k, v in loaded.state_dict.items() if (layer_index(k) is None or layer_index(k) < exit_layer)}
    if lora is not None:
        below = {p: ab for p, ab in lora.pairs.items() if layer_index(p) is not None and layer_index(p) < exit_layer}
        LoraDeltas(below, lora.scale).merge_into(state, source)
    config = dataclasses.replace(loaded.config, num_layers=exit_layer)
    return LlamaModel(config, state, dtype, device, weight_dtype, tp=tp)


# the widest first pass a draft copy runs as a graph (widths 2, 4, 8, 16): the copy catches up on
# the last draft and the model's token after it when a round accepted every draft, and on the
# tokens of rounds prompt lookup drafted alone (StaticLayers)
CATCH_UP_WIDTH = 16


class DraftStack:
    """The draft copy at inference: its runner (workspace, inputs, KV cache on the model's blocks),
    its draft head, and which positions of each sequence its cache holds."""

    def __init__(self, model, main_runner: ModelRunner, adapters: Optional[ExitAdapters], exit_layer: int,
                 states: Optional[SequenceStates] = None):
        c = model.config
        if model.num_layers != exit_layer:
            raise ValueError(f"DraftStack: the draft model has {model.num_layers} layers, exit_layer is {exit_layer}")
        self.model = model
        self.exit_layer = exit_layer
        self.runner = ModelRunner(
            model, KVCache(exit_layer, main_runner.num_blocks, main_runner.block_size, c.num_kv_heads, c.head_dim,
                           model.dtype, model.device),
            max_tokens=main_runner.max_tokens, max_seqs=main_runner.max_seqs, max_logit_rows=1,
            max_blocks_per_seq=main_runner.max_blocks_per_seq, max_model_len=main_runner.max_model_len)
        self.head = DraftHead(model, exit_layer, adapters, main_runner.max_seqs)
        # the copy's passes (and its draft head) as CUDA graphs wherever the model's decode steps are graphs
        self.static = None if main_runner.graph_capture is None else \
            self.static_pass(capture=main_runner.graph_capture)
        self._states = torch.empty(main_runner.max_seqs, c.hidden_size, dtype=model.dtype, device=model.device)
        # each sequence's [num_preemptions when recorded, positions with right draft K/V, positions
        # written] (SequenceState.copy)
        self.states = SequenceStates() if states is None else states
        self.catch_up_tokens = 0  # tokens run beyond one a sequence and pass (the draft planner's clock)

    def static_pass(self, capture: bool, max_batch: Optional[int] = None) -> StaticLayers:
        """The copy's passes on static buffers, its draft head included (`capture`: as CUDA graphs), for
        up to `max_batch` sequences (default: the engine's)."""
        return StaticLayers(self.runner, max_batch or self.runner.max_seqs, capture=capture,
                            max_width=CATCH_UP_WIDTH, head=self.head)

    def weight_bytes(self) -> int:
        """Bytes a drafted token reads: the copy's E layers, then the draft head."""
        return sum(layer_weight_bytes(self.model, i) for i in range(self.exit_layer)) + self.head.weight_bytes()

    # ---- passes ------------------------------------------------------------------------------
    def first_pass(self, seqs: list[Sequence], drafts: Optional[list[list[int]]] = None) -> torch.Tensor:
        """A round's first pass: runs each sequence's unseen tokens, through its pending one and
        then its `drafts` so far (none by default), through the copy; returns the draft head's
        column logits (DraftHead.columns) of each sequence's last token `[B, K]`. Tokens beyond the
        step budget go in chunks."""
        return self._advance(seqs, drafts, [self._valid(seq) for seq in seqs], continues=False)

    def next_pass(self, seqs: list[Sequence], drafts: list[list[int]]) -> torch.Tensor:
        """A later pass of the round: the drafts of each sequence the copy has not run yet (the
        newest one, for a chain of layer drafts; with lookup tokens, more), as first_pass."""
        return self._advance(seqs, drafts, [self.states.slot(seq, "copy")[2] for seq in seqs], continues=True)

    def chained_pass(self, seqs: list[Sequence], offsets: list[int], tokens: torch.Tensor) -> torch.Tensor:
        """A pass of drafts still on the device (`tokens` `[n]` int64, not read back): seqs[i]'s at
        position pending + offsets[i], the copy having run every position before it. Returns their
        draft head column logits `[n, K]`. Needs the static pass (`chains`)."""
        rows = []
        for seq, offset in zip(seqs, offsets):
            position = seq.num_computed_tokens + offset
            record = self.states.slot(seq, "copy")
            if record[2] != position:
                raise RuntimeError(f"DraftStack.chained_pass: sequence {seq.seq_id} has its draft K/V up to "
                                   f"position {record[2]}, the pass is at {position}")
            record[2] = position + 1
            rows.append(Row(seq, position, [0]))  # the token: tokens[i], on the device
        return self.static.run_with_tokens(rows, tokens, continues=True)  # (within a round: see _advance)

    def chains(self, n: int) -> bool:
        """Whether `n` sequences' drafts can go from pass to pass on the device (chained_pass)."""
        return self.static is not None and 0 < n <= self.static.max_batch

    def _advance(self, seqs: list[Sequence], drafts: Optional[list[list[int]]], starts: list[int],
                 continues: bool) -> torch.Tensor:
        """`continues`: a later pass of the round, so that a static pass over the same sequences as
        the last one, one position further, may be built from that pass's inputs (nothing is
        scheduled within a round: StaticPass._build)."""
        rows, one_token_each, states = [], True, self.states
        for b, (seq, start) in enumerate(zip(seqs, starts)):
            draft = drafts[b] if drafts is not None else []
            pending = seq.num_computed_tokens  # the position of the pending token; drafts follow it
            if start == pending + len(draft):  # the usual pass: the copy has run all but the newest token
                tokens = [draft[-1]] if draft else [seq.last_token_id]
            elif start < pending:
                tokens = seq.token_slice(start, pending + 1) + draft
            elif start == pending:
                tokens = [seq.last_token_id] + draft
            else:
                tokens = draft[start - pending - 1:]
            one_token_each = one_token_each and len(tokens) == 1
            states.slot(seq, "copy")[2] = pending + 1 + len(draft)
            rows.append(Row(seq, start, tokens))
        if one_token_each:
            if self.static is not None and 0 < len(rows) <= self.static.max_batch:  # (what static.takes checks)
                return self.static.run(rows, continues, one_token_each=True)
            return self.head.columns(self._run(rows))
        self.catch_up_tokens += sum(len(row.tokens) - 1 for row in rows if row.tokens)
        if self.static is not None and all(row.tokens for row in rows) and self.static.takes(rows):
            return self.static.run(rows)  # a short catch-up (the last round's last draft): one graph
        return self.head.columns(self._chunked(seqs, [(row.start, row.tokens) for row in rows]))

    def behind_all(self, seqs: list[Sequence]) -> list[int]:
        """Tokens the copy would run before the pending token in each sequence's next first pass (as
        _valid reckons it, without recording anything)."""
        out, states = [], self.states
        for seq in seqs:
            record, computed = states.slot(seq, "copy"), seq.num_computed_tokens
            out.append(computed if record is None or record[0] != seq.num_preemptions else
                       computed - min(record[1], computed))
        return out

    def after_fused_round(self, seq: Sequence, pending: int, drafts: int, accepted: int) -> None:
        """After a fused round (eecore.speculative.fused_round) from the pending token at `pending`:
        the copy wrote positions pending - 1 .. pending + drafts - 1 (so whatever it held before,
        everything before them was right), and those up to the last draft the model accepted are."""
        state = self.states.of(seq)
        state.copy = [seq.num_preemptions, min(pending + drafts, pending + accepted + 1), pending + drafts]

    def settle(self, seq: Sequence, agreed_end: int) -> None:
        """After verification: the written positions below `agreed_end` (the pending token and the
        drafts the model agreed with) keep their draft K/V."""
        record = self.states.slot(seq, "copy")
        record[1] = min(record[2], agreed_end, seq.num_computed_tokens)

    def release(self, seq: Sequence) -> None:
        self.states.clear_slot(seq, "copy")

    def tracked(self) -> int:
        """Sequences the copy keeps K/V bookkeeping for."""
        return self.states.count("copy")

    def _valid(self, seq: Sequence) -> int:
        state = self.states.of(seq)
        record = state.copy
        if record is None or record[0] != seq.num_preemptions:  # new, or its blocks were freed
            record = state.copy = [seq.num_preemptions, 0, 0]
        return min(record[1], seq.num_computed_tokens)

    def _run(self, rows: list[Row]) -> torch.Tensor:
        """The copy's layers over `rows`, op by op: the layer-E states of every token `[T, d]`."""
        inputs = self.runner.prepare(rows)
        hidden = self.runner.embed(inputs)
        return self.runner.run_layers(hidden, inputs.attn, 0, self.exit_layer)

    def _chunked(self, seqs: list[Sequence], pieces: list[tuple[int, list[int]]]) -> torch.Tensor:
        """first_pass with catch-up rows: each pass takes up to the runner's token budget, splitting
        a row where it must, and the last position of each sequence is copied out when it runs (its
        layer-E state `[B, d]`: the chunks run op by op, since a static pass gives only each row's
        last token)."""
        out = self._states[: len(seqs)]
        budget = self.runner.max_tokens
        queue = deque((b, start, tokens) for b, (start, tokens) in enumerate(pieces))
        while queue:
            rows, finished, used = [], [], 0
            while queue and used < budget:
                b, start, tokens = queue.popleft()
                take = min(len(tokens), budget - used)
                rows.append(Row(seqs[b], start, tokens[:take]))
                used += take
                if take < len(tokens):
                    queue.appendleft((b, start + take, tokens[take:]))
                else:
                    finished.append((b, used - 1))
            hidden = self._run(rows)  # indexed by token below
            if finished:
                dev = hidden.device
                out.index_copy_(0, torch.tensor([b for b, _ in finished], device=dev),
                                hidden.index_select(0, torch.tensor([r for _, r in finished], device=dev)))
        return out
