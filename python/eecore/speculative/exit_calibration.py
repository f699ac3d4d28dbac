"""Calibrating the exit threshold of layer drafts (`LayerDrafts.exit_threshold`; `eecore calibrate
--exit-ready`) with CALM's textual consistency and Learn-then-Test (eecore.exits.calibration).

Each candidate threshold, from the most conservative down, decodes every calibration prompt with
drafts at least that sure (by the config's exit measure) emitted unverified, and its risk is the
mean 1 - ROUGE-L of those outputs to full depth's. Fixed-sequence testing keeps the least
conservative candidate whose p-value stays below epsilon: with probability at least 1 - epsilon
over the draw of the prompts, the expected loss of prompts drawn alike stays within the tolerance.

Full depth's outputs come from the same engine with no exits (a threshold above 1: verified
self-speculation, whose greedy output is full depth's), and each candidate only changes the
threshold the draft picker reads, so the copy, its KV cache layout and the measure stay as built.
Prompts run one at a time, so one prompt's loss does not depend on which others share its steps.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional, Sequence

import torch

from eecore.exits import calibration as ltt
from eecore.exits.calibrator import text_loss
from eecore.sampling_params import SamplingParams

NEVER = 1.01  # above every confidence: no draft exits


@dataclass
class ExitCalibration:
    passed: bool
    data: dict  # what `eecore calibrate --exit-ready` writes

    @property
    def threshold(self) -> Optional[float]:
        return self.data["threshold"]


def default_exit_candidates() -> list[float]:
    """1.0 (no draft is surer than certain), then steps of 0.02 down to 0.5: below that the copy's
    exits leave full depth's path within a few tokens (docs/exit-ready.md)."""
    return [round(1.0 - i / 50, 10) for i in range(26)]


def calibrate_exit_threshold(llm, prompts: Sequence, tolerance: float, epsilon: float, *, max_tokens: int = 64,
                             ignore_eos: bool = False, candidates: Optional[list[float]] = None,
                             loss: str = "rouge-l", p_value: str = "hoeffding-bentkus") -> ExitCalibration:
    """`llm`: built with layer drafts and an exit threshold (any: each candidate replaces it)."""
    strategy = llm.engine.strategy
    picker = getattr(strategy, "picker", None)
    config = getattr(strategy, "config", None)
    if picker is None or not getattr(config, "trusts_drafts", False):
        raise ValueError("calibrate --exit-ready: build the LLM with layer drafts and an exit threshold "
                         "(LayerDrafts(exit_threshold=...)); each candidate replaces the threshold")
    prompts = list(prompts)
    need = ltt.min_prompts(tolerance, epsilon, p_value)
    if len(prompts) < need:
        raise ValueError(f"calibrate: {len(prompts)} prompts cannot pass any threshold with tolerance={tolerance}, "
                         f"epsilon={epsilon}: even a zero-risk candidate needs n >= {need} prompts")
    params = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=ignore_eos)
    built = picker.exit_threshold

    def outputs(threshold: float):
        picker.exit_threshold = threshold
        try:
            return [llm.generate([p], params)[0] for p in prompts]
        finally:
            picker.exit_threshold = built

    full = [o.token_ids for o in outputs(NEVER)]
    exit_shares: list[float] = []
    exit_layer = config.exit_layer

    # the binomial p-value needs 0/1 losses: each loss becomes 1 with its own probability, drawn
    # once per prompt (as eecore.exits.calibrator does)
    uniforms = torch.rand(len(prompts), generator=torch.Generator().manual_seed(0), dtype=torch.float64).tolist()

    def risk_of(threshold: float) -> float:
        outs = outputs(threshold)
        layers = [e for o in outs for e in o.exit_layers]
        exit_shares.append(sum(e == exit_layer for e in layers) / max(len(layers), 1))
        losses = [text_loss(loss, o.token_ids, ref) for o, ref in zip(outs, full)]
        if p_value == "binomial":
            losses = ltt.binarize(losses, uniforms)
        return sum(losses) / len(losses)

    cands = candidates or default_exit_candidates()
    result = ltt.fixed_sequence_test(cands, risk_of, len(prompts), tolerance, epsilon, p_value)
    # a threshold of 1.0 always passes once there are enough prompts (nothing is surer than
    # certain): it is the start of the sequence, not an answer
    passed = result.chosen is not None and result.chosen < 1.0
    data = {
        "exit_layer": exit_layer,
        "exit_measure": config.layer.exit_measure or "probability",
        "draft_threshold": config.layer.stop_below,
        "consistency": "text", "text_loss": loss, "tolerance": tolerance, "epsilon": epsilon, "p_value": p_value,
        "prompts": len(prompts), "max_tokens": max_tokens,
        "threshold": result.chosen if passed else None,
        "candidates": [{"threshold": r.threshold, "risk": r.risk, "p_value": r.p_value, "passed": r.passed,
                        "exit_share": share} for r, share in zip(result.candidates, exit_shares)],
    }
    return ExitCalibration(passed, data)
