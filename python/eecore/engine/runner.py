"""Runs the model over a step's rows: inputs into preallocated buffers, layers, logits.

The runner owns the buffers (workspace, step inputs, logits) and the KV cache; it knows nothing
of scheduling. Decoding strategies (full depth, early exit, self-speculation) drive it one layer
range at a time.

What a strategy uses of it: `prepare`, `embed`, `run_layers`, `logits`, `forward` and
`mark_computed` to run passes; the engine's passes on static buffers, `static_decode` and
`static_verify` (None where there are none); and the few facts and operations below
"what strategies read" (the step limits, the KV cache's block size and device, whether static
passes are graphs, the residual-stream workspace, copying and filling K/V). The KV cache, the
input builder and the workspace themselves (`kv`, `builder`, `ws`) are the engine's.
"""
from __future__ import annotations

from typing import Callable, Optional

import numpy as np
import torch

from eecore.engine.inputs import InputBuilder, Row, StepInputs
from eecore.engine.kv_cache import KVCache
from eecore.engine.piecewise import PiecewiseForward
from eecore.engine.static_decode import StaticDecode, StaticVerify
from eecore.engine.step_buffers import tap_points
from eecore.models.llama import AttentionInputs, LlamaModel


class ModelRunner:
    def __init__(self, model: LlamaModel, kv_cache: KVCache, *, max_tokens: int, max_seqs: int,
                 max_logit_rows: int, max_blocks_per_seq: int, max_model_len: int):
        self.model = model
        self.max_model_len = max_model_len
        self.kv = kv_cache
        self.num_layers = model.num_layers
        self.ws = model.new_workspace(max_tokens)
        self.builder = InputBuilder(max_tokens, max_seqs, max_blocks_per_seq, kv_cache.block_size, model.device,
                                    pad_block=kv_cache.pad_block)
        d, vocab = model.config.hidden_size, model.config.vocab_size
        self._head_in = torch.empty(max_logit_rows, d, dtype=model.dtype, device=model.device)
        self._logits = torch.empty(max_logit_rows, vocab, dtype=model.dtype, device=model.device)
        self._logits_f32 = self._logits if model.dtype == torch.float32 else \
            torch.empty(max_logit_rows, vocab, dtype=torch.float32, device=model.device)
        # tokens each layer has processed: how tests prove that no work is repeated
        self.layer_tokens = [0] * model.num_layers
        # full-depth decode steps and verify passes on static buffers (CUDA graphs), set by the engine
        # where enabled
        self.static_decode: Optional[StaticDecode] = None
        self.static_verify: Optional[StaticVerify] = None
        # every other pass through all layers with all but attention graphed (engine.piecewise)
        self.piecewise: Optional[PiecewiseForward] = None
        # EngineConfig.decode_ahead (None: the environment's switch, else by device)
        self.decode_ahead: Optional[bool] = None

    # ---- what strategies read (module doc) -------------------------------------------------
    @property
    def max_seqs(self) -> int:
        """Sequences a step may hold."""
        return self.builder.max_seqs

    @property
    def max_tokens(self) -> int:
        """Tokens a step may hold (the workspace's rows)."""
        return self.builder.max_tokens

    @property
    def max_blocks_per_seq(self) -> int:
        """Blocks a sequence's block table may hold."""
        return self.builder.max_blocks

    @property
    def block_size(self) -> int:
        """Tokens a KV block holds."""
        return self.kv.block_size

    @property
    def num_blocks(self) -> int:
        """KV blocks sequences may own (the pad block not counted)."""
        return self.kv.num_blocks

    @property
    def device(self) -> torch.device:
        """Where the KV cache, the workspace and the step inputs are."""
        return self.kv.tensor.device

    @property
    def graph_capture(self) -> Optional[bool]:
        """How a strategy builds its own passes on static buffers: None where the engine has none
        (the CPU, enforce_eager: every pass runs op by op), else whether they are recorded as CUDA
        graphs (True) or run eagerly on their buffers (False: how the CPU tests drive them), as the
        engine's decode step is."""
        return None if self.static_decode is None else self.static_decode.capture

    def hidden_workspace(self, n: int) -> torch.Tensor:
        """The first `n` rows `[n, d]` of the residual-stream workspace, where `embed` starts a pass
        and the layers leave it (a static pass's state lives there between its graphs)."""
        return self.ws.hidden[:n]

    def copy_kv_slots(self, src: torch.Tensor, dst: torch.Tensor) -> None:
        """Every layer's K/V of slots `src` copied to slots `dst` (int64 on the device)."""
        self.kv.copy_slots(src, dst)

    def fill_kv(self, hidden: torch.Tensor, positions: torch.Tensor, slot_mapping: torch.Tensor,
                start_layer: torch.Tensor) -> None:
        """The K/V of layers start_layer[t]..L-1 of each token t, computed from its residual stream
        `hidden[t]` (early exit's skipped layers; ops.kv_fill)."""
        self.model.fill_kv(self.kv.tensor, hidden, positions, slot_mapping, start_layer)

    # ---- passes -----------------------------------------------------------------------------
    def prepare(self, rows: list[Row]) -> StepInputs:
        inputs = self.builder.build(rows)
        if self.model.is_encoder_decoder:
            self._encode_starting(rows)
        return inputs

    def _encode_starting(self, rows: list[Row]) -> None:
        """Encoder-decoder models: a row at position 0 starts its prefill (first admission, or
        readmission after a preemption dropped its blocks), so its request's encoder runs now, once,
        and writes every decoder layer's cross-attention K/V into the request's cross blocks."""
        seqs = [r.seq for r in rows if r.start == 0]
        if not seqs:
            return
        bs = self.kv.block_size
        slots = []
        for seq in seqs:
            pos = np.arange(len(seq.encoder_token_ids))
            slots.append(np.asarray(seq.cross_block_table, dtype=np.int64)[pos // bs] * bs + pos % bs)
        slot_mapping = torch.from_numpy(np.concatenate(slots)).to(self.model.device)
        encoded = self.model.encode([s.encoder_token_ids for s in seqs])
        self.model.write_cross_kv(self.kv.tensor, encoded, slot_mapping)

    def embed(self, inputs: StepInputs) -> torch.Tensor:
        """The residual stream `[T, d]` of this step, initialized with the token embeddings."""
        return self.model.embed_tokens(inputs.token_ids, self.hidden_workspace(inputs.num_tokens))

    def run_layers(self, hidden: torch.Tensor, attn: AttentionInputs, start: int, end: int, *,
                   count: bool = True, before: Optional[Callable[[int], None]] = None) -> torch.Tensor:
        """Layers start..end-1 over the rows of `hidden` (in place), writing their K/V: the one layer
        loop, which every pass runs (eager and static). `count`: add the rows to `layer_tokens`
        (a static pass counts its real rows itself, not its padding); `before(i)`: called before
        layer i runs (early exit's static segments keep the stream a check compares with there)."""
        model, kv, ws = self.model, self.kv, self.ws
        for i in range(start, end):
            if before is not None:
                before(i)
            model.layer(i, hidden, attn, kv.k(i), kv.v(i), ws)
            if count:
                self.layer_tokens[i] += hidden.shape[0]
        return hidden

    def logits(self, hidden_rows: torch.Tensor) -> torch.Tensor:
        """fp32 logits `[n, V]` of residual-stream rows `[n, d]` (final norm, then LM head)."""
        n = hidden_rows.shape[0]
        normed = self.model.final_norm_(hidden_rows, self._head_in[:n])
        logits = self.model.lm_head_logits(normed, self._logits[:n])
        if logits.dtype != torch.float32:
            logits = self._logits_f32[:n].copy_(logits)
        return logits

    def forward(self, rows: list[Row], tap=None) -> tuple[StepInputs, torch.Tensor]:
        """All layers over `rows`; returns the inputs and the final residual stream `[T, d]`.
        `tap=(E, out)` also copies the residual stream after layer E-1 into `out` `[T, d]`; with E a
        tuple of layers (ascending), after each of them, side by side into `out` `[T, len(E) * d]`."""
        if tap is None and self.piecewise is not None and self.piecewise.takes(rows):
            return self.piecewise.run(rows)
        inputs = self.prepare(rows)
        hidden = self.embed(inputs)
        self.run_layers_tapped(hidden, inputs.attn, tap)
        self.mark_computed(rows)
        return inputs, hidden

    def run_layers_tapped(self, hidden: torch.Tensor, attn: AttentionInputs, tap=None, *,
                          count: bool = True) -> torch.Tensor:
        """Every layer over `hidden` (in place), copying the stream out where `tap` (as in `forward`)
        says (into the first rows of its `out`: one a row of `hidden`); `count` as in run_layers."""
        if tap is None:
            return self.run_layers(hidden, attn, 0, self.num_layers, count=count)
        points, out = tap_points(tap), tap[1]
        d, n, start = hidden.shape[1], hidden.shape[0], 0
        for k, E in enumerate(points):
            self.run_layers(hidden, attn, start, E, count=count)
            out[:n, k * d: (k + 1) * d].copy_(hidden)
            start = E
        return self.run_layers(hidden, attn, start, self.num_layers, count=count)

    @staticmethod
    def mark_computed(rows: list[Row]) -> None:
        """The rows' tokens have their K/V in the cache now."""
        for row in rows:
            row.seq.num_computed_tokens = max(row.seq.num_computed_tokens, row.start + len(row.tokens))
