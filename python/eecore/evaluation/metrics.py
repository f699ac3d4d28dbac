"""How a strategy's outputs compare with full depth's: the quality half of `eecore eval`.

Definitions (the JSON fields of a result row):
- early_exit_rate, mean_layers_per_token: over decoded tokens only. The first token of every
  output comes from the prefill, which always runs all L layers, so it is left out of both
  (as bench/e2e_early_exit.py does). None when no output decoded a second token.
- token_agreement: over all prompts, the positions whose token equals full depth's token at that
  position, divided by the positions of the longer of the two outputs (a position only one output
  reaches disagrees). All generated tokens count, the first one too: it is what the user gets.
  1.0 when both outputs are empty.
- exact_match: the fraction of prompts whose token ids equal full depth's exactly.
- rouge_l_to_full: mean over prompts of ROUGE-L F1 (eecore.text.rouge) of the text against full depth's.
- rouge_l_to_reference / full_rouge_l_to_reference: the same against the prompt set's reference
  outputs, for the strategy and for full depth, over the prompts that have one (None when none do).
- strategy_metrics: the mean over outputs of each metric the strategy reports (e.g. acceptance_rate).
"""
from __future__ import annotations

import statistics
from typing import Optional, Sequence

from eecore.outputs import RequestOutput
from eecore.text.rouge import rouge_l

__all__ = ["token_matches", "decode_depth", "compare_outputs", "strategy_metrics"]

# what every engine reports, whatever the strategy: not a property of the strategy
_ENGINE_METRICS = {"num_prompt_tokens", "num_output_tokens", "num_preemptions", "ttft_s", "prefill_s",
                   "time_per_output_token_s", "tokens_per_s", "mean_layers_per_token", "early_exit_rate"}


def token_matches(a: Sequence[int], b: Sequence[int]) -> tuple[int, int]:
    """(positions where a and b hold the same token, positions of the longer one)."""
    return sum(x == y for x, y in zip(a, b)), max(len(a), len(b))


def decode_depth(outs: Sequence[RequestOutput], num_layers: int) -> tuple[Optional[float], Optional[float]]:
    """(early-exit rate, mean layers per token) of the decoded tokens: the prefill's token left out."""
    layers = [e for o in outs for e in o.exit_layers[1:]]
    if not layers:
        return None, None
    return sum(e < num_layers for e in layers) / len(layers), float(statistics.mean(layers))


def strategy_metrics(outs: Sequence[RequestOutput]) -> dict[str, float]:
    names = sorted({k for o in outs for k, v in o.metrics.items()
                    if k not in _ENGINE_METRICS and isinstance(v, (int, float))})
    out = {}
    for name in names:
        values = [o.metrics[name] for o in outs if isinstance(o.metrics.get(name), (int, float))]
        out[name] = float(statistics.mean(values))
    return out


def _mean_rouge(texts: Sequence[str], references: Sequence[Optional[str]]) -> Optional[float]:
    scores = [rouge_l(t, r) for t, r in zip(texts, references) if r is not None]
    return float(statistics.mean(scores)) if scores else None


def compare_outputs(outs: Sequence[RequestOutput], full_outs: Sequence[RequestOutput], num_layers: int,
                    references: Optional[Sequence[Optional[str]]] = None) -> dict:
    """The quality fields of a result row (module doc), with one record per prompt under "outputs"."""
    if len(outs) != len(full_outs):
        raise ValueError(f"compare_outputs: {len(outs)} outputs against {len(full_outs)} full-depth outputs")
    references = list(references) if references is not None else [None] * len(outs)
    if len(references) != len(outs):
        raise ValueError(f"compare_outputs: {len(references)} references for {len(outs)} outputs")
    matches = positions = 0
    per_prompt = []
    for i, (o, f, ref) in enumerate(zip(outs, full_outs, references)):
        m, n = token_matches(o.token_ids, f.token_ids)
        matches, positions = matches + m, positions + n
        record = dict(index=i, text=o.text, full_text=f.text, token_agreement=m / n if n else 1.0,
                      exact_match=list(o.token_ids) == list(f.token_ids), rouge_l_to_full=rouge_l(o.text, f.text))
        if ref is not None:
            record["reference"] = ref
            record["rouge_l_to_reference"] = rouge_l(o.text, ref)
            record["full_rouge_l_to_reference"] = rouge_l(f.text, ref)
        per_prompt.append(record)
    ee_rate, mean_layers = decode_depth(outs, num_layers)
    return dict(
        early_exit_rate=ee_rate, mean_layers_per_token=mean_layers, num_layers=num_layers,
        token_agreement=matches / positions if positions else 1.0,
        exact_match=sum(r["exact_match"] for r in per_prompt) / len(per_prompt),
        rouge_l_to_full=float(statistics.mean(r["rouge_l_to_full"] for r in per_prompt)),
        rouge_l_to_reference=_mean_rouge([o.text for o in outs], references),
        full_rouge_l_to_reference=_mean_rouge([f.text for f in full_outs], references),
        strategy_metrics=strategy_metrics(outs), outputs=per_prompt)
