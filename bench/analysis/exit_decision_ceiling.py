"""How well can a dynamic exit at the exit-ready copy's layer 8 tell its right tokens from its wrong
ones? The seed's Table 1 point (ROUGE-L to full >= 0.77 at >= 54% of the layers skipped) needs
about 74% of the tokens exiting at layer 8 (22 of 30 layers skipped), and a greedy continuation
leaves full depth's path at its first wrong exit, so those exits must be right nearly always.

Teacher-forced along full depth's greedy continuation of each prompt (`record` of
bench/analysis/hybrid_policy_replay.py), every position has the copy's token and what an exit
decision could read there. Each decision ranks the positions; the table gives, on held-out
prompts, the share of positions it can let exit (coverage) at a precision (the share of exits
equal to full depth's token), and its precision at a coverage:

- `top-1 probability` (eecore's `accept="confident"` rule), the top-2 gap, the entropy;
- `logistic`: a logistic regression on those three;
- `+ lookup`: with two more inputs, whether prompt lookup (2-4-grams, the hybrid preset's) has a
  draft there and whether it is the copy's token;
- `MLP`: a 32-unit MLP on the same inputs;
- `state + ...`: a logistic regression on the copy's layer-8 state as well (CALM's classifier reads
  the hidden state);
- `+ history`: `logistic + lookup` with what a sequence's past says: how often the copy agreed with
  full depth over the 8 positions before the last 4 (those full depth has checked by the time a
  round of 4 drafts decides), the previous position's top-1 probability, and the position;
- `+ saturation` (with `--saturation L ...`): `logistic + lookup` and the MLP with what the copy's
  earlier layers L say, each read through the draft head: whether its top-1 is the exit's token, and
  its probability of that token (a prediction that settled early might be right more often, as
  patience-based early exit assumes);
- `perfect`: a decision that knows where the copy is right, whose coverage is the copy's agreement.

The learned decisions are fit on code prompts of the training packages (the copy never saw the
held-out ones) and, with `--train-chat N`, N everyday requests of the training topics in the chat
template; they are scored on the held-out code prompts of the other benches (`--eval-prompts`) and,
with `--eval-chat N`, on N held-out everyday requests (the `everyday` bench prompts), each table of
its own.

`--write FILE` also saves the "logistic + lookup" decision, fit on all the training positions, as
an exit decision file for the shipped draft layers (`LayerDrafts(exit_measure=FILE)`;
eecore.speculative.exit_decision): the shipped one is
`python bench/analysis/exit_decision_ceiling.py --train-chat 160 --eval-chat 24 --write
python/eecore/data/smollm2-135m-instruct-exit-decision.json`.

    python bench/analysis/exit_decision_ceiling.py [--train-prompts 320] [--train-chat 0] [--eval-prompts 24]
        [--eval-chat 0] [--max-tokens 96] [--saturation L ...] [--write FILE] [--out-name exit-decision-ceiling]

writes bench/results/<machine>/<out-name>-<date>.json.
"""
from __future__ import annotations

import argparse
import os
import sys
from typing import Optional

import torch

from eecore.exits.decision import fit_logistic, fit_scorer
from eecore.text.ngram_index import NgramIndex
from hybrid_policy_replay import record

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # bench/: common.py
from common import cpu_model, save_results  # noqa: E402

PRECISIONS = (0.97, 0.98, 0.99)
COVERAGES = (0.5, 0.6, 0.7, 0.74)
SKIPPED_PER_EXIT = 22 / 30  # an exit at layer 8 of SmolLM2's 30


def training_prompts(n: int) -> list[str]:
    """`n` code-completion prompts of the training packages (the held-out prompts' recipe)."""
    from eecore.evaluation.prompts import heldout_code_prompt_records
    from eecore.sources.corpus import build_corpus

    files = build_corpus().train
    records = heldout_code_prompt_records(n, packages=sorted({f.package for f in files}), files=files)
    return [r.text for r in records]


def lookup_drafts(rec: dict) -> list[int]:
    """Prompt lookup's next token at each continuation position (-1: no 2-4-gram match)."""
    index = NgramIndex(2, 4)
    index.extend(rec["prompt"])
    drafts = []
    for token in rec["full"]:
        proposal = index.propose(1)
        drafts.append(proposal[0] if proposal else -1)
        index.extend([token])
    return drafts


def features(records: list[dict]) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(scalar inputs [n, 5], the copy's states [n, d], right [n]) over every record's positions.
    Scalar inputs: top-1 probability, top-2 gap, entropy, lookup has a draft, lookup agrees."""
    scalars, states, right = [], [], []
    for rec in records:
        p1, p2 = torch.tensor(rec["copy_p"]), torch.tensor(rec["copy_p2"])
        copy, full = torch.tensor(rec["copy"]), torch.tensor(rec["full"])
        lookup = torch.tensor(lookup_drafts(rec))
        scalars.append(torch.stack([p1, p1 - p2, torch.tensor(rec["copy_entropy"]),
                                    (lookup >= 0).float(), (lookup == copy).float()], 1))
        states.append(rec["states"].float())
        right.append((copy == full).float())
    return torch.cat(scalars), torch.cat(states), torch.cat(right)


def saturation(records: list[dict], layers: tuple[int, ...]) -> torch.Tensor:
    """[n, 2 len(layers)] per position: whether each tapped layer's top-1 is the exit's token, then
    its probability of that token (`record(..., taps=layers)`); [n, 0] without layers."""
    rows = [torch.tensor([rec[f"agree{L}"] for L in layers] + [rec[f"p{L}"] for L in layers]).reshape(
        2 * len(layers), len(rec["full"])).T for rec in records]
    return torch.cat(rows)


def history(records: list[dict], lag: int = 4, window: int = 8) -> torch.Tensor:
    """[n, 4] per position: the copy's agreement with full depth over positions [t - lag - window,
    t - lag) (0.5 where there are none) and how many there are (/ window), the previous position's
    top-1 probability, and the position / 96."""
    rows = []
    for rec in records:
        right = (torch.tensor(rec["copy"]) == torch.tensor(rec["full"])).float()
        p1 = torch.tensor(rec["copy_p"])
        n = len(right)
        seen = torch.cat([torch.zeros(1), right.cumsum(0)])  # seen[t] = agreements before t
        hi = (torch.arange(n) - lag).clamp_min(0)
        lo = (hi - window).clamp_min(0)
        count = (hi - lo).float()
        recent = torch.where(count > 0, (seen[hi] - seen[lo]) / count.clamp_min(1), torch.full((n,), 0.5))
        previous = torch.cat([torch.tensor([0.5]), p1[:-1]])
        rows.append(torch.stack([recent, count / window, previous, torch.arange(n).float() / 96], 1))
    return torch.cat(rows)


def fit(x: torch.Tensor, y: torch.Tensor, hidden: int = 0, epochs: int = 40, weight_decay: float = 1e-4,
        keep: Optional[dict] = None):
    """A logistic regression (or a one-hidden-layer MLP) predicting `y` from `x`; returns a scorer.
    `keep`: filled with the regression's normalization and weights (for an exit decision file)."""
    if keep is not None and not hidden:
        keep.update(fit_logistic(x, y, weight_decay).coefficients())
    return fit_scorer(x, y, hidden, epochs, weight_decay)


def curve(score: torch.Tensor, right: torch.Tensor) -> dict:
    """Coverage at each of PRECISIONS and precision (and wrong exits per 64 tokens) at each of
    COVERAGES, exiting the highest-scored positions first."""
    ranked = right[score.argsort(descending=True, stable=True)]
    kept = torch.arange(1, len(ranked) + 1)
    precision, coverage = ranked.cumsum(0) / kept, kept / len(ranked)
    row = {}
    for p in PRECISIONS:
        ok = (precision >= p).nonzero()
        row[f"coverage_at_precision_{p}"] = coverage[ok[-1]].item() if len(ok) else 0.0
    for c in COVERAGES:
        i = max(int(c * len(ranked)) - 1, 0)
        row[f"precision_at_coverage_{c}"] = precision[i].item()
        row[f"wrong_exits_per_64_at_coverage_{c}"] = 64 * c * (1 - precision[i].item())
    return row


def table(title: str, decisions: dict, right: torch.Tensor) -> list[dict]:
    """Prints and returns each decision's curve on `right`."""
    print(title)
    head = "".join(f"{'cov@' + str(p):>10}" for p in PRECISIONS) + "".join(f"{'prec@' + str(c):>10}" for c in COVERAGES)
    print(f"{'decision':28}{head}{'wrong/64@0.74':>15}")
    rows = []
    for name, score in decisions.items():
        row = dict(decision=name, **curve(score, right))
        rows.append(row)
        cells = "".join(f"{row[f'coverage_at_precision_{p}']:10.3f}" for p in PRECISIONS)
        cells += "".join(f"{row[f'precision_at_coverage_{c}']:10.3f}" for c in COVERAGES)
        print(f"{name:28}{cells}{row['wrong_exits_per_64_at_coverage_0.74']:15.2f}")
    return rows


def main() -> None:
    from eecore.sources.general_chat_prompts import general_instruction_records

    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--train-prompts", type=int, default=320)
    ap.add_argument("--train-chat", type=int, default=0, help="everyday requests of the training topics")
    ap.add_argument("--eval-prompts", type=int, default=24)
    ap.add_argument("--eval-chat", type=int, default=0, help="held-out everyday requests")
    ap.add_argument("--max-tokens", type=int, default=96)
    ap.add_argument("--saturation", type=int, nargs="*", default=[], metavar="L",
                    help="also decisions reading the copy's layers L (each below the exit) through the draft head")
    ap.add_argument("--write", default=None, metavar="FILE", help="save the logistic + lookup decision here")
    ap.add_argument("--out-name", default="exit-decision-ceiling")
    args = ap.parse_args()

    taps = tuple(args.saturation)
    train = record(0, args.max_tokens, texts=training_prompts(args.train_prompts), features=True, taps=taps)
    if args.train_chat:
        chat = [r.text for r in general_instruction_records(args.train_chat, "train")]
        train += record(0, args.max_tokens, kind="everyday", texts=chat, features=True, taps=taps)
    x, h, y = features(train)
    past = history(train)
    settled = saturation(train, taps)
    kept: dict = {}
    scorers = {
        "logistic": (lambda z, zh, f=fit(x[:, :3], y): f(z[:, :3])),
        "logistic + lookup": (lambda z, zh, f=fit(x, y, keep=kept): f(z)),
        "MLP + lookup": (lambda z, zh, f=fit(x, y, hidden=32): f(z)),
        "state + logistic + lookup": (lambda z, zh, f=fit(torch.cat([h, x], 1), y, epochs=30, weight_decay=1e-3):
                                      f(torch.cat([zh, z], 1))),
        "logistic + lookup + history": (lambda z, zh, zp, f=fit(torch.cat([x, past], 1), y):
                                        f(torch.cat([z, zp], 1))),
    }
    if taps:  # these read the tapped layers' inputs where the others read the history
        scorers["logistic + lookup + saturation"] = (lambda z, zh, zs, f=fit(torch.cat([x, settled], 1), y):
                                                     f(torch.cat([z, zs], 1)))
        scorers["MLP + lookup + saturation"] = (lambda z, zh, zs, f=fit(torch.cat([x, settled], 1), y, hidden=32):
                                                f(torch.cat([z, zs], 1)))
    print(f"CPU: {cpu_model()}; {len(train)} training prompts ({len(y)} positions, copy agreement {y.mean():.3f})")
    evals = {"held-out code": record(args.eval_prompts, args.max_tokens, features=True, taps=taps)}
    if args.eval_chat:
        evals["held-out everyday requests"] = record(args.eval_chat, args.max_tokens, kind="everyday", features=True,
                                                     taps=taps)
    results = dict(model="SmolLM2-135M-Instruct", draft="the shipped exit-ready copy, exit 8", max_tokens=args.max_tokens,
                   train_prompts=len(train), train_positions=len(y), train_agreement=y.mean().item(),
                   saturation_layers=list(taps), evals={})
    for name, held_out in evals.items():
        xe, he, ye = features(held_out)
        extra = {"history": history(held_out), "saturation": saturation(held_out, taps)}
        agreement = ye.mean().item()
        decisions = {"top-1 probability": xe[:, 0], "top-2 gap": xe[:, 1], "negative entropy": -xe[:, 2],
                     **{k: f(xe, he, *[v for e, v in extra.items() if k.endswith(e)]) for k, f in scorers.items()},
                     "perfect": ye}
        rows = table(f"\n{name}: {len(held_out)} prompts, {len(ye)} positions, copy agreement {agreement:.3f}",
                     decisions, ye)
        print(f"perfect decision: {agreement:.1%} of tokens exit, {agreement * SKIPPED_PER_EXIT:.1%} of the layers skipped")
        results["evals"][name] = dict(prompts=len(held_out), positions=len(ye), agreement=agreement,
                                      layers_skipped_by_perfect_decision=agreement * SKIPPED_PER_EXIT, rows=rows)
    if args.write:
        from eecore.models.exit_adapter import SHIPPED_DRAFT_FILE
        from eecore.speculative.exit_decision import AgreementModel, file_sha256

        AgreementModel(**kept, draft_file_sha256=file_sha256(SHIPPED_DRAFT_FILE), how=(
            f"logistic regression fit by bench/analysis/exit_decision_ceiling.py on {len(y)} positions: full "
            f"depth's greedy continuations ({args.max_tokens} tokens) of {args.train_prompts} code prompts of "
            f"the training packages and {args.train_chat} everyday requests of the training topics, the "
            f"draft copy teacher-forced along them")).save(args.write)
        print(f"exit decision: {args.write}")
    path = save_results(args.out_name, results)
    print(f"results: {path}")


if __name__ == "__main__":
    main()
