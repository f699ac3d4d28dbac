"""`eecore calibrate`: CALM's consistency calibration of early-exit thresholds by Learn-then-Test.

Goal: thresholds such that, with probability >= 1 - epsilon over the draw of the calibration
prompts, the expected inconsistency with full depth is <= delta (the tolerance). The risk's unit is
the calibration PROMPT, assumed i.i.d. like the prompts the thresholds will serve.

Consistency (the loss of one prompt, in [0, 1]):
- "token": the fraction of the prompt's output tokens (all but the first, which prefill makes at
  full depth) whose exit token differs from the full-depth token, from the teacher-forced record
  (eecore.exits.calibration_data): cheap, one full-depth pass per prompt for every candidate.
- "text": CALM's textual consistency. Each candidate is evaluated by generating with it for real
  and comparing the output with full depth: 1 - ROUGE-L F1 over token ids ("rouge-l"), or 1 if the
  outputs differ at all ("exact"). Fixed-sequence testing stops at the first failing candidate, so
  only a few candidates beyond the chosen one are ever generated. Under batch rule "all" a row's
  exits depend on the other rows of its batch, which would tie the prompts' losses together, so
  each prompt runs alone (batch 1); under "compact" rows exit independently and run batched.

Token consistency is computed at batch 1, where the rules "all" and "compact" coincide; in a larger
"all" batch a row exits at the layer where every row is confident, never earlier than alone.

Families of candidates (tested from the most conservative, 1.0 = never exit, downwards):
- "global": one threshold at every checked layer (eecore.exits.calibration.default_candidates);
  with `decay` tau, it is CALM's decaying threshold clip(0.9 lambda + 0.1 exp(-tau t / N), 0, 1)
  with N = max_tokens.
- "per-layer" (token consistency): the prompts are split (even / odd positions in the file). On the
  first half, each checked layer c gets, for a precision level s, the smallest candidate threshold
  lambda_c(s) at which at most a fraction s of the tokens above it at that layer are inconsistent
  (layers whose confident tokens are reliable get low thresholds, noisy layers high ones). The
  family s = 0, 0.005, ..., 0.5 (preceded by "never exit") is then a 1-D sequence fixed before the
  second half is looked at, and LTT runs on the second half only, so the guarantee holds as is.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional, Sequence

import torch

from eecore.exits import calibration as ltt
from eecore.exits.calibration_data import CalibrationRecord, full_thresholds, layer_thresholds, record, token_losses
from eecore.exits.agreement import decision_sha256
from eecore.exits.config import EarlyExitConfig
from eecore.exits.thresholds_file import CALIBRATED_MEASURES, adapter_identity, file_sha256, model_identity
from eecore.sampling_params import SamplingParams
from eecore.text.rouge import rouge_l

CONSISTENCY = ("token", "text")
TEXT_LOSSES = ("rouge-l", "exact")
FAMILIES = ("global", "per-layer")
PRECISION_LEVELS = [i / 200 for i in range(101)]  # s of the per-layer family


@dataclass
class CalibrationSettings:
    measure: str
    tolerance: float                       # delta: the tolerated expected inconsistency
    epsilon: float                         # the allowed probability that the guarantee fails
    batch_rule: str = "all"
    classifier_path: Optional[str] = None
    decision_path: Optional[str] = None       # measure "agreement" (None: the shipped decision file)
    min_exit_layer: int = 1
    check_every: int = 1
    decay: Optional[float] = None
    p_value: str = "hoeffding-bentkus"
    consistency: str = "token"
    text_loss: str = "rouge-l"
    family: str = "global"
    max_tokens: int = 64
    ignore_eos: bool = False
    candidates: Optional[list[float]] = None  # default: calibration.default_candidates()
    seed: int = 0                             # of the binomial method's binarization

    def __post_init__(self):
        if self.measure not in CALIBRATED_MEASURES:
            raise ValueError(f"calibrate: 'measure' must be one of {CALIBRATED_MEASURES}, got {self.measure!r}")
        for name in ("tolerance", "epsilon"):
            if not 0.0 < getattr(self, name) < 1.0:
                raise ValueError(f"calibrate: {name!r} must be in (0, 1), got {getattr(self, name)!r}")
        for name, allowed in (("p_value", ltt.P_VALUE_METHODS), ("consistency", CONSISTENCY),
                              ("text_loss", TEXT_LOSSES), ("family", FAMILIES)):
            if getattr(self, name) not in allowed:
                raise ValueError(f"calibrate: {name!r} must be one of {allowed}, got {getattr(self, name)!r}")
        if self.family == "per-layer" and self.consistency == "text":
            raise ValueError("calibrate: the per-layer family needs token consistency (it is shaped on the "
                             "per-token record)")
        if not isinstance(self.max_tokens, int) or self.max_tokens < 2:
            raise ValueError(f"calibrate: 'max_tokens' must be an int >= 2 (the first token never exits), "
                             f"got {self.max_tokens!r}")
        if self.candidates is not None:
            c = list(self.candidates)
            if not c or not all(0.0 <= x <= 1.0 for x in c) or c != sorted(c, reverse=True):
                raise ValueError("calibrate: 'candidates' must be thresholds in [0, 1], most conservative "
                                 "(largest) first")

    def early_exit(self, threshold=1.0) -> EarlyExitConfig:
        return EarlyExitConfig(measure=self.measure, threshold=threshold, min_exit_layer=self.min_exit_layer,
                               check_every=self.check_every, decay=self.decay, batch_rule=self.batch_rule,
                               classifier_path=self.classifier_path, decision_path=self.decision_path)


@dataclass
class Calibration:
    passed: bool
    data: dict                                       # the thresholds file's content
    record: Optional[CalibrationRecord] = field(default=None, repr=False)

    def summary(self) -> str:
        d = self.data
        tested = d["candidates"]
        head = (f"{d['prompts']['count']} prompts, {d['tokens']} tokens; delta={d['tolerance']}, "
                f"epsilon={d['epsilon']}, {d['p_value']} p-values, {d['consistency']} consistency, "
                f"{d['family']} family; {len(tested)} candidates tested")
        if not self.passed:
            failed = next((c for c in tested if not c["passed"]), None)
            why = "" if failed is None else (f": candidate {_fmt(failed['threshold'])} has empirical risk "
                                             f"{failed['risk']:.4f} and p-value {failed['p_value']:.4g} > epsilon")
            return f"no threshold that exits passes{why} ({head})"
        last = next(c for c in reversed(tested) if c["passed"])
        return (f"threshold {_fmt(d['threshold'])}: empirical risk {last['risk']:.4f}, p-value {last['p_value']:.4g}, "
                f"est. mean layers/token {last.get('mean_exit_layer', float('nan')):.2f} of "
                f"{d['model']['num_layers']} ({head})")


def _fmt(t) -> str:
    return f"{t:.6g}" if isinstance(t, (int, float)) else "per-layer [" + ", ".join(f"{x:.3g}" for x in t) + "]"


def calibrate(llm, prompts: Sequence, settings: CalibrationSettings, prompts_file: Optional[str] = None,
              reuse: Optional[CalibrationRecord] = None) -> Calibration:
    """Calibrates on `prompts` (strings or token ids) with `llm`, built with no early exit (and the
    exit adapters to calibrate, if any). Returns whether a threshold passed, and the file content.

    `reuse`: the record of an earlier token-consistency calibration (`Calibration.record`) on the
    same llm and prompts with the same measure, checked layers, max_tokens and ignore_eos, so that
    several tolerances or batch rules cost one full-depth pass (the record depends on none of them)."""
    from eecore.engine.decoding import FullDepthDecoder

    if not isinstance(llm.engine.strategy, FullDepthDecoder):
        raise ValueError("calibrate: build the LLM without early_exit / speculative (it runs full depth and "
                         "tries each candidate itself)")
    prompts = list(prompts)
    n_test = len(prompts) // 2 if settings.family == "per-layer" else len(prompts)
    need = ltt.min_prompts(settings.tolerance, settings.epsilon)
    if n_test < need:
        extra = " in the testing half (the per-layer family splits them)" if settings.family == "per-layer" else ""
        raise ValueError(f"calibrate: {len(prompts)} prompts cannot pass any threshold with tolerance="
                         f"{settings.tolerance}, epsilon={settings.epsilon}: even a zero-risk candidate needs "
                         f"(1 - delta)^n <= epsilon, i.e. n >= {need} prompts{extra}")
    config = settings.early_exit()
    config.validate_for(llm.model.num_layers)
    cands = settings.candidates or ltt.default_candidates()
    if settings.consistency == "token":
        if reuse is not None:
            _check_reusable(reuse, prompts, settings, llm.model.num_layers, llm.engine.runner, llm.exit_adapters)
        rec = reuse or record(llm, prompts, config, settings.max_tokens, settings.ignore_eos)
        result, mean_layers, threshold, n_used = _token_ltt(rec, cands, settings)
        tokens = rec.num_tokens
    else:
        rec = None
        result, mean_layers, tokens = _text_ltt(llm, prompts, cands, settings)
        threshold, n_used = result.chosen, len(prompts)
    data = _file_data(llm, settings, result, mean_layers, threshold, n_used, tokens, prompts_file, len(prompts))
    # "never exit" (threshold 1.0, no decay) always passes once there are enough prompts: it is the
    # start of the sequence, not an answer
    passed = result.chosen is not None and not (settings.decay is None and _never_exits(result.chosen))
    return Calibration(passed, data, rec)


def _check_reusable(rec: CalibrationRecord, prompts: list, s: CalibrationSettings, num_layers: int, runner,
                    adapters) -> None:
    from eecore.exits.decoder import build_measure, checked_layers

    config = s.early_exit()
    heads = {E: None for E in adapters.exit_layers()} if adapters is not None else {}
    layers = checked_layers(config, build_measure(config, runner, 1, heads, adapters), num_layers, heads)
    mine = (len(prompts), num_layers, layers, s.measure, s.max_tokens, s.ignore_eos)
    theirs = (len(rec.prompts), rec.num_layers, rec.checked_layers, rec.measure, rec.max_tokens, rec.ignore_eos)
    if mine != theirs:
        raise ValueError(f"calibrate: the reused record (prompts, layers, checked layers, measure, max_tokens, "
                         f"ignore_eos = {theirs}) was not made for this calibration {mine}")


def _never_exits(threshold) -> bool:
    values = threshold if isinstance(threshold, list) else [threshold]
    return all(v >= 1.0 for v in values)


# ---- token consistency ------------------------------------------------------------------------

def _token_ltt(rec: CalibrationRecord, cands: list[float], s: CalibrationSettings):
    n = len(rec.prompts)
    if s.family == "global":
        thresholds, labels, test = layer_thresholds(rec, cands), cands, list(range(n))
    else:
        shape, test = list(range(0, n, 2)), list(range(1, n, 2))
        per_check = _per_layer_family(rec, shape, cands)
        thresholds = torch.tensor([[1.0] * len(rec.checked_layers)] + per_check, dtype=torch.float32)
        labels = [full_thresholds(rec, row) for row in thresholds.tolist()]
    losses, mean_layers = token_losses(_subset(rec, test), thresholds, s.decay, s.max_tokens)
    losses = _maybe_binarize(losses, s)
    result = ltt.fixed_sequence_test(range(len(labels)), lambda k: losses[k].mean(), len(test),
                                     s.tolerance, s.epsilon, s.p_value)
    for r in result.candidates:
        r.threshold = labels[r.threshold]
    layers = mean_layers[: len(result.candidates)].tolist()
    chosen = result.chosen
    if chosen is not None:
        result.chosen = labels[chosen]
    return result, layers, result.chosen, len(test)


def _subset(rec: CalibrationRecord, idx: list[int]) -> CalibrationRecord:
    return CalibrationRecord(rec.checked_layers, rec.num_layers, [rec.prompts[i] for i in idx],
                             [rec.outputs[i] for i in idx], rec.measure, rec.max_tokens, rec.ignore_eos)


def _per_layer_family(rec: CalibrationRecord, shape: list[int], cands: list[float]) -> list[list[float]]:
    """lambda_c(s) for each precision level s (module doc), from the shaping prompts `shape`."""
    grid = torch.tensor(sorted(cands), dtype=torch.float32)  # ascending: the first admissible is the smallest
    conf = torch.cat([rec.prompts[i].confidence for i in shape], dim=1)      # [C, N]
    bad = ~torch.cat([rec.prompts[i].consistent for i in shape], dim=1)
    above = conf[:, None, :] > grid[None, :, None]                          # [C, G, N]
    count = above.sum(-1).float()
    errors = (above & bad[:, None, :]).sum(-1).float()
    error_rate = torch.where(count > 0, errors / count.clamp(min=1), torch.zeros_like(count))  # [C, G]
    family = []
    for level in PRECISION_LEVELS:
        ok = error_rate <= level + 1e-12          # [C, G]; the largest candidate (1.0) has no tokens: ok
        first = ok.to(torch.uint8).argmax(1)       # the smallest admissible threshold of each layer
        family.append(grid[first].tolist())
    return family


def _maybe_binarize(losses: torch.Tensor, s: CalibrationSettings) -> torch.Tensor:
    """The binomial p-value is exact for 0/1 losses only (eecore.exits.calibration)."""
    if s.p_value != "binomial":
        return losses
    u = torch.rand(losses.shape[1], generator=torch.Generator().manual_seed(s.seed), dtype=torch.float64)
    return (u[None, :] < losses.double()).float()


# ---- text consistency -------------------------------------------------------------------------

def rouge_l_f1(a: list[int], b: list[int]) -> float:
    """ROUGE-L F1 of two token-id sequences (eecore.text.rouge on the ids written as words): token ids,
    not text, so that two outputs that decode alike but differ in tokens still count as different."""
    return rouge_l(" ".join(map(str, a)), " ".join(map(str, b)))


def text_loss(kind: str, output: list[int], reference: list[int]) -> float:
    if kind == "exact":
        return 0.0 if output == reference else 1.0
    return 1.0 - rouge_l_f1(output, reference)


def _text_ltt(llm, prompts, cands, s: CalibrationSettings):
    from eecore.exits.decoder import EarlyExitDecoder

    params = SamplingParams(max_tokens=s.max_tokens, temperature=0.0, ignore_eos=s.ignore_eos)
    full = [o.token_ids for o in llm.generate(prompts, params)]
    tokens = sum(max(len(o) - 1, 0) for o in full)
    engine = llm.engine
    full_depth = engine.strategy
    u = torch.rand(len(prompts), generator=torch.Generator().manual_seed(s.seed), dtype=torch.float64).tolist()
    mean_layers: list[float] = []

    def risk_of(threshold: float) -> float:
        config = s.early_exit(threshold)
        engine.strategy = EarlyExitDecoder(engine.runner, engine.sampler, config, llm.exit_adapters)
        try:
            if s.batch_rule == "all":  # alone, so one prompt's loss does not depend on the others
                outs = [llm.generate([p], params)[0] for p in prompts]
            else:
                outs = llm.generate(prompts, params)
        finally:
            engine.strategy = full_depth
        losses = [text_loss(s.text_loss, o.token_ids, ref) for o, ref in zip(outs, full)]
        if s.p_value == "binomial":
            losses = ltt.binarize(losses, u)
        layers = [e for o in outs for e in o.exit_layers]
        mean_layers.append(sum(layers) / max(len(layers), 1))
        return sum(losses) / len(losses)

    result = ltt.fixed_sequence_test(cands, risk_of, len(prompts), s.tolerance, s.epsilon, s.p_value)
    return result, mean_layers, tokens


# ---- the file ---------------------------------------------------------------------------------

def _file_data(llm, s: CalibrationSettings, result, mean_layers, threshold, n_used, tokens, prompts_file,
               n_prompts) -> dict:
    from eecore.exits.decoder import build_measure, checked_layers

    adapters = llm.exit_adapters
    heads = {E: None for E in adapters.exit_layers()} if adapters is not None else {}
    config = s.early_exit()
    measure = build_measure(config, llm.engine.runner, 1, heads, adapters)  # only asked which layers it covers
    data = {
        "model": model_identity(llm.model),
        "measure": s.measure, "batch_rule": s.batch_rule,
        "min_exit_layer": s.min_exit_layer, "check_every": s.check_every,
        "checked_layers": checked_layers(config, measure, llm.model.num_layers, heads),
        "decay": s.decay, "max_tokens": s.max_tokens,
        "exit_adapter": adapter_identity(adapters),
        "classifier": {"sha256": file_sha256(s.classifier_path)} if s.measure == "classifier" else None,
        "decision": {"sha256": decision_sha256(s.decision_path)} if s.measure == "agreement" else None,
        "consistency": s.consistency, "text_loss": s.text_loss if s.consistency == "text" else None,
        "family": s.family,
        "tolerance": s.tolerance, "epsilon": s.epsilon, "p_value": s.p_value,
        "binomial_seed": s.seed if s.p_value == "binomial" else None,
        "prompts": {"file": prompts_file, "sha256": file_sha256(prompts_file) if prompts_file else None,
                    "count": n_prompts, "tested": n_used},
        "tokens": tokens,
        "threshold": threshold,
        "candidates": [{"threshold": r.threshold, "risk": r.risk, "p_value": r.p_value, "passed": r.passed,
                        "mean_exit_layer": m} for r, m in zip(result.candidates, mean_layers)],
    }
    return data
