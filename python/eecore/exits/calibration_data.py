"""The full-depth record that token-level calibration works from, and the losses of thresholds on it.

`record` runs each calibration prompt's full-depth greedy output once more, teacher-forced (one
prefill-like pass over prompt + output per sequence, layer by layer), and keeps, at every exit
layer the decoder would check, each generated token's confidence and whether exiting there would
give the full-depth token. The confidences come from the decoder's own measure objects
(`eecore.exits.decoder.build_measure`), so calibration and inference measure the same thing.

Approximation (CALM's too): the record sees the full-depth prefix. At inference an earlier exit
fills the skipped layers' K/V from its exit state, so later tokens attend to a slightly different
cache; the text-consistency mode (`eecore.exits.calibrator`) measures that end to end instead.

Token j of an output (0-based) is produced by prefill at full depth when j == 0, so only tokens
j >= 1 can exit; their decay index (CALM's t) is j.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch

from eecore import ops
from eecore.engine.inputs import Row
from eecore.engine.sequence import Sequence
from eecore.exits.config import EarlyExitConfig
from eecore.exits.decoder import build_measure, checked_layers
from eecore.models.exit_adapter import DraftHead
from eecore.sampling_params import SamplingParams


@dataclass
class PromptRecord:
    confidence: torch.Tensor   # fp32 [C, T]: confidence of output token j = 1..T at checked layer c
    consistent: torch.Tensor   # bool [C, T]: the exit token at layer c equals the full-depth token


@dataclass
class CalibrationRecord:
    checked_layers: list[int]  # the exit layers E the decoder checks, ascending
    num_layers: int
    prompts: list[PromptRecord]
    outputs: list[list[int]]   # the full-depth greedy outputs
    # what the confidences are of and how the outputs were generated: a record is reusable only
    # under the same ones (eecore.exits.calibrator.calibrate's `reuse`)
    measure: Optional[str] = None
    max_tokens: Optional[int] = None
    ignore_eos: Optional[bool] = None

    @property
    def num_tokens(self) -> int:
        """Tokens that could exit (every output token but the first)."""
        return sum(r.confidence.shape[1] for r in self.prompts)


@torch.no_grad()
def record(llm, prompts: list, config: EarlyExitConfig, max_tokens: int, ignore_eos: bool = False
           ) -> CalibrationRecord:
    """Full-depth greedy outputs of `prompts` (str or token ids) on `llm` (built with no early exit,
    with the exit adapters to calibrate, if any), then the per-token record under `config`'s
    measure, min_exit_layer and check_every."""
    outs = llm.generate(prompts, SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=ignore_eos))
    engine, model = llm.engine, llm.model
    L = model.num_layers
    chunk = engine.config.max_num_batched_tokens  # the runner's workspace holds this many rows
    adapters = llm.exit_adapters
    heads = {} if adapters is None else {E: DraftHead(model, E, adapters, chunk) for E in adapters.exit_layers()}
    measure = build_measure(config, engine.runner, chunk, heads, adapters)
    if measure is None:
        raise ValueError("calibrate: measure 'static' has no confidence to calibrate")
    layers = checked_layers(config, measure, L, heads)
    if not layers:
        raise ValueError(f"calibrate: no exit layer is checked with min_exit_layer={config.min_exit_layer}, "
                         f"check_every={config.check_every} on a {L}-layer model"
                         + (" (with exit adapters only their layers are checked)" if heads else ""))
    normed = torch.empty(chunk, model.config.hidden_size, dtype=model.dtype, device=model.device)
    records = []
    for out in outs:
        prompt_ids, output = out.prompt_token_ids, out.token_ids
        records.append(_record_one(engine, model, measure, heads, layers, prompt_ids, output, chunk, normed))
    return CalibrationRecord(layers, L, records, [o.token_ids for o in outs], config.measure, max_tokens,
                             ignore_eos)


def _record_one(engine, model, measure, heads, layers, prompt_ids, output, chunk, normed) -> PromptRecord:
    P, T = len(prompt_ids), len(output) - 1
    C = len(layers)
    confidence = torch.zeros(C, max(T, 0), dtype=torch.float32)
    consistent = torch.ones(C, max(T, 0), dtype=torch.bool)
    if T <= 0:
        return PromptRecord(confidence, consistent)
    ids = prompt_ids + output[:-1]          # position P - 1 + j predicts output token j
    target = torch.tensor(output[1:], device=model.device)
    index = {E: c for c, E in enumerate(layers)}
    for E, h, previous, first, end in teacher_forced(engine, model, ids, P, layers, chunk,
                                                     measure.needs_previous_hidden):
        cols = slice(first - P, end - P)
        if E == layers[0]:
            measure.start_positions(ids, first, end)
        conf = measure(E, h, previous)
        top1 = measure.top1 if measure.gives_top1 else _exit_token(model, heads, E, h, normed)
        confidence[index[E], cols] = conf.float().cpu()
        consistent[index[E], cols] = (top1.view(-1) == target[cols]).cpu()
    return PromptRecord(confidence, consistent)


def teacher_forced(engine, model, ids: list[int], first_row: int, layers: list[int], chunk: int,
                   keep_previous: bool = False):
    """One prefill-like pass of `ids` through the model, layer by layer in chunks of `chunk` rows
    (the runner's workspace), under a KV allocation of its own (never scheduled). For each chunk
    holding positions >= `first_row` and each exit layer E of `layers` (ascending), yields
    (E, the residual stream of those positions after layer E-1 `[n, d]` (a view: read it before
    the next item), the stream before layer E-1 where `keep_previous`, the positions' first, end)."""
    seq = Sequence(ids, SamplingParams(max_tokens=1))
    engine.blocks.grow(seq, len(ids))
    checked = set(layers)
    try:
        for start in range(0, len(ids), chunk):  # chunked like a long prefill
            end = min(start + chunk, len(ids))
            inputs = engine.runner.prepare([Row(seq, start, ids[start:end])])
            hidden = engine.runner.embed(inputs)
            first = max(first_row, start)
            if first >= end:
                engine.runner.run_layers(hidden, inputs.attn, 0, model.num_layers)
                continue
            rows = slice(first - start, end - start)
            for E in range(1, layers[-1] + 1):
                previous = hidden[rows].clone() if keep_previous and E in checked else None
                engine.runner.run_layers(hidden, inputs.attn, E - 1, E)
                if E in checked:
                    yield E, hidden[rows], previous, first, end
            # the layers above the last check only fill the cache the next chunk attends to
            engine.runner.run_layers(hidden, inputs.attn, layers[-1], model.num_layers)
    finally:
        engine.blocks.free(seq)


def _exit_token(model, heads, E, h, normed) -> torch.Tensor:
    """The greedy token of a row exiting at E: through the exit adapter / draft head if E has one,
    else the LM head on the final-normed state (the decoder's two paths)."""
    if E in heads:
        return heads[E].top2_gap(h)[1]
    return ops.lm_head_top2_gap(model.final_norm_(h, normed[: h.shape[0]]), model.lm_head)[1]


def token_losses(rec: CalibrationRecord, thresholds: torch.Tensor, decay: Optional[float] = None,
                 max_tokens: Optional[int] = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-prompt losses of K candidate threshold settings.

    thresholds: fp32 [K, C], the base threshold of each candidate at each checked layer.
    A token exits at the first checked layer whose confidence > its threshold (the decoder's rule,
    with CALM's decay clip(0.9 lambda + 0.1 exp(-tau t / N), 0, 1) for token index t when `decay`).
    Returns (loss [K, n]: the fraction of each prompt's exitable tokens whose exit token differs
    from full depth, 0 for a prompt with none; mean exit layer [K]: over all tokens, counting the
    full-depth first token, i.e. the decoder's mean layers per token).
    """
    K = thresholds.shape[0]
    layer_of = torch.tensor(rec.checked_layers + [rec.num_layers], dtype=torch.float32)
    losses = torch.zeros(K, len(rec.prompts))
    layer_sum = torch.zeros(K)
    total = 0
    for i, r in enumerate(rec.prompts):
        T = r.confidence.shape[1]
        total += T + 1
        layer_sum += rec.num_layers  # the first token: always full depth
        if T == 0:
            continue
        thr = thresholds[:, :, None].expand(K, -1, T)                      # [K, C, T]
        if decay is not None:
            t = torch.arange(1, T + 1, dtype=torch.float32)
            term = 0.1 * torch.exp(-decay * t / max_tokens)
            thr = (0.9 * thr + term).clamp(0.0, 1.0)
        exceed = r.confidence[None] > thr                                  # [K, C, T]
        exited = exceed.any(1)                                             # [K, T]
        first = exceed.to(torch.uint8).argmax(1)                           # first True (0 if none)
        ok = r.consistent[None].expand(K, -1, -1).gather(1, first[:, None]).squeeze(1)
        losses[:, i] = (exited & ~ok).float().mean(-1)
        where = torch.where(exited, first, torch.full_like(first, len(rec.checked_layers)))
        layer_sum += layer_of[where].sum(-1)
    return losses, layer_sum / max(total, 1)


def layer_thresholds(rec: CalibrationRecord, values: list[float]) -> torch.Tensor:
    """[K, C] thresholds of K global candidates (the same value at every checked layer)."""
    return torch.tensor(values, dtype=torch.float32)[:, None].expand(-1, len(rec.checked_layers)).contiguous()


def full_thresholds(rec: CalibrationRecord, per_check: list[float]) -> list[float]:
    """The EarlyExitConfig per-layer list (one value per layer, index E-1) of thresholds at the
    checked layers; unchecked layers get 1.0 (never read, but kept in range)."""
    out = [1.0] * rec.num_layers
    for E, v in zip(rec.checked_layers, per_check):
        out[E - 1] = float(v)
    return out
