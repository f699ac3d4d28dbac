"""Learn-then-Test (LTT) statistics for CALM's consistency calibration: p-values and fixed-sequence testing.

The question for every candidate threshold lambda is the null hypothesis H(lambda): "the expected
loss R(lambda) > delta". The loss is measured per calibration PROMPT (i.i.d. units; the tokens of
one output depend on each other, so they are not), bounded in [0, 1]. A valid p-value p(lambda)
satisfies P(p(lambda) <= u) <= u whenever H(lambda) holds.

Fixed-sequence testing: the candidates are ordered before looking at the data (most conservative
first); they are tested in that order at level epsilon, and testing stops at the first candidate
that fails. Every candidate before it is declared valid. The family-wise error rate is then
<= epsilon, so with probability >= 1 - epsilon every declared-valid threshold, and in particular
the least conservative one we choose, has R <= delta. No multiplicity correction is needed, which
is why a fine grid of candidates costs nothing statistically.

p-values (LTT paper, Angelopoulos et al. 2021):
- "binomial": P(Binomial(n, delta) <= n * R_hat). Exact, but only for 0/1 losses. Losses in
  [0, 1] are first binarized with a seeded uniform draw per prompt (`binarize`): 1[U_i < loss_i]
  is a Bernoulli variable with the same mean, so the test stays exact (at the price of some noise).
- "hoeffding-bentkus": min(exp(-n * h1(min(R_hat, delta), delta)), e * P(Binomial(n, delta) <=
  ceil(n * R_hat))), valid for any losses in [0, 1]; h1(a, b) = a log(a/b) + (1-a) log((1-a)/(1-b)).
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Sequence

P_VALUE_METHODS = ("hoeffding-bentkus", "binomial")


def binomial_cdf(k: int, n: int, p: float) -> float:
    """P(Binomial(n, p) <= k), summed in log space (exact enough for any n we calibrate with)."""
    if k < 0:
        return 0.0
    if k >= n or p <= 0.0:
        return 1.0
    if p >= 1.0:
        return 0.0
    log_p, log_q = math.log(p), math.log1p(-p)
    log_n_fact = math.lgamma(n + 1)
    terms = [log_n_fact - math.lgamma(i + 1) - math.lgamma(n - i + 1) + i * log_p + (n - i) * log_q
             for i in range(k + 1)]
    top = max(terms)
    return min(1.0, math.exp(top) * sum(math.exp(t - top) for t in terms))


def _h1(a: float, b: float) -> float:
    """The Bernoulli KL divergence KL(a || b) (Hoeffding's exponent), with 0 log 0 = 0."""
    out = 0.0
    if a > 0:
        out += a * math.log(a / b)
    if a < 1:
        out += (1 - a) * math.log((1 - a) / (1 - b))
    return out


def _check(risk_hat: float, n: int, delta: float) -> None:
    if not isinstance(n, int) or n < 1:
        raise ValueError(f"p-value: 'n' (number of calibration prompts) must be an int >= 1, got {n!r}")
    if not 0.0 < delta < 1.0:
        raise ValueError(f"p-value: 'delta' (the tolerance) must be in (0, 1), got {delta!r}")
    if not 0.0 <= risk_hat <= 1.0:
        raise ValueError(f"p-value: the empirical risk must be in [0, 1], got {risk_hat!r}")


def binomial_pvalue(risk_hat: float, n: int, delta: float) -> float:
    """For 0/1 losses: P(Binomial(n, delta) <= number of losses), with number = n * risk_hat."""
    _check(risk_hat, n, delta)
    # round: n * risk_hat is an integer count up to float error
    return binomial_cdf(int(round(n * risk_hat)), n, delta)


def hoeffding_bentkus_pvalue(risk_hat: float, n: int, delta: float) -> float:
    """For losses in [0, 1]: the smaller of Hoeffding's and Bentkus' p-values."""
    _check(risk_hat, n, delta)
    hoeffding = math.exp(-n * _h1(min(risk_hat, delta), delta))
    # ceil: Bentkus' bound is on the count of a binomial at or below the (real) sum of losses;
    # the epsilon keeps an integer-valued sum that float arithmetic nudged up from rounding up.
    bentkus = math.e * binomial_cdf(math.ceil(n * risk_hat - 1e-9), n, delta)
    return min(hoeffding, bentkus, 1.0)


def pvalue(method: str, risk_hat: float, n: int, delta: float) -> float:
    if method == "hoeffding-bentkus":
        return hoeffding_bentkus_pvalue(risk_hat, n, delta)
    if method == "binomial":
        return binomial_pvalue(risk_hat, n, delta)
    raise ValueError(f"p-value method must be one of {P_VALUE_METHODS}, got {method!r}")


def binarize(losses: Sequence[float], uniforms: Sequence[float]) -> list[float]:
    """1[U_i < loss_i]: a Bernoulli loss with the mean of the [0, 1] loss (see the module doc).
    The same U_i are used for every candidate, so binarized losses stay monotone in the threshold."""
    return [1.0 if u < loss else 0.0 for loss, u in zip(losses, uniforms)]


@dataclass
class CandidateResult:
    threshold: object          # the candidate: a number, or whatever the family's parameter is
    risk: float                # empirical risk: mean per-prompt loss
    p_value: float
    passed: bool


@dataclass
class LTTResult:
    candidates: list[CandidateResult]   # the tested prefix, in testing order
    chosen: object                      # the least conservative passing candidate, or None

    @property
    def passed(self) -> bool:
        return self.chosen is not None


def fixed_sequence_test(ordered_candidates: Sequence, risk_of, n: int, delta: float, epsilon: float,
                        method: str = "hoeffding-bentkus") -> LTTResult:
    """Tests `ordered_candidates` (most conservative first, fixed before seeing the data) in order.

    `risk_of(candidate)` returns the mean per-prompt loss over the n calibration prompts; it is
    called lazily, only up to the first failure (the text-consistency mode generates per call).
    Returns every tested candidate with its risk and p-value, and the last one that passed.
    """
    if not 0.0 < epsilon < 1.0:
        raise ValueError(f"LTT: 'epsilon' must be in (0, 1), got {epsilon!r}")
    if not 0.0 < delta < 1.0:
        raise ValueError(f"LTT: 'delta' (the tolerance) must be in (0, 1), got {delta!r}")
    results: list[CandidateResult] = []
    chosen = None
    for candidate in ordered_candidates:
        risk = float(risk_of(candidate))
        p = pvalue(method, risk, n, delta)
        ok = p <= epsilon
        results.append(CandidateResult(candidate, risk, p, ok))
        if not ok:
            break
        chosen = candidate
    return LTTResult(results, chosen)


def min_prompts(delta: float, epsilon: float, method: str = "hoeffding-bentkus") -> int:
    """The fewest prompts with which even a zero-risk candidate can pass: (1 - delta)^n <= epsilon
    (both p-values equal (1 - delta)^n at zero empirical risk)."""
    return math.ceil(math.log(epsilon) / math.log1p(-delta))


def default_candidates() -> list[float]:
    """Candidate thresholds, most conservative first: 1.0 (never exits: confidences are <= 1), then
    steps of 0.01 down to 0, merged with points 1 - 10^-x (x from 2 to 6, 8 per decade) because the
    cosine measure lives just below 1. Fixed in advance, as fixed-sequence testing requires."""
    linear = [round(1.0 - i / 100, 10) for i in range(101)]
    near_one = [1.0 - 10 ** (-(2 + j / 8)) for j in range(33)]
    return sorted(set(linear) | set(near_one), reverse=True)
