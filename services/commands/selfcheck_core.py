"""The statistics and the report of `specbus selfcheck`, without NATS (services/commands/selfcheck.py
talks to the stack and calls these).

- `chi2_sf`: the chi-square survival function from the regularized upper incomplete gamma
  function, Q(dof/2, x/2), evaluated as Numerical Recipes (3rd ed., section 6.2) does: the
  series for x < a + 1, Lentz's continued fraction beyond (DLMF 8.7.1 and 8.9.2).
- `merge_small_bins`, `g_statistic`, `pooled_gof`: the G-test (likelihood-ratio goodness of fit,
  asymptotically chi-square with bins - 1 degrees of freedom). Bins expected to hold fewer than
  MIN_EXPECTED samples are merged, since the chi-square approximation is poor for them.
  Independent groups (samples conditioned on different prefixes) add up: the sum of their G
  statistics is chi-square with the sum of their degrees of freedom.
- `distribution_bins`: the exact next-token distribution as top-n tokens plus one "rest" bin.
- `same_token_bypass`: what a known-bad rejection rule does to the distribution, for the power
  demonstration.
- `logprob_diffs`: one generated token's logprobs against the same position of a scoring pass.
- `CheckResult`, `render_table`, `report_json`: the report.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, field

import numpy as np

ALPHA = 0.01  # family-wise false-failure rate of the distribution check (Bonferroni across cells)
MIN_EXPECTED = 5.0  # bins expected to hold fewer samples than this are merged
GAMMA_EPS = 1e-15
GAMMA_MAX_ITER = 10_000


# ---------------------------------------------------------------------------------------------
# chi-square tail


def regularized_gamma_q(a: float, x: float) -> float:
    """Q(a, x) = Gamma(a, x) / Gamma(a) for a > 0, x >= 0 (Numerical Recipes 6.2: series for
    P when x < a + 1, modified Lentz continued fraction for Q otherwise)."""
    if x <= 0:
        return 1.0
    log_prefactor = a * math.log(x) - x - math.lgamma(a)
    if x < a + 1:
        term = total = 1.0 / a
        denominator = a
        for _ in range(GAMMA_MAX_ITER):
            denominator += 1
            term *= x / denominator
            total += term
            if abs(term) < abs(total) * GAMMA_EPS:
                break
        return max(0.0, 1.0 - total * math.exp(log_prefactor))
    tiny = 1e-300
    b = x + 1 - a
    c, d = 1 / tiny, 1 / b
    h = d
    for i in range(1, GAMMA_MAX_ITER):
        an = -i * (i - a)
        b += 2
        d = an * d + b
        d = tiny if abs(d) < tiny else d
        c = b + an / c
        c = tiny if abs(c) < tiny else c
        d = 1 / d
        delta = d * c
        h *= delta
        if abs(delta - 1) < GAMMA_EPS:
            break
    return math.exp(log_prefactor) * h


def chi2_sf(x: float, dof: int) -> float:
    """P(X >= x) for X ~ chi-square with dof degrees of freedom."""
    if dof <= 0:
        raise ValueError(f"dof must be positive, got {dof}")
    return regularized_gamma_q(dof / 2, x / 2)


# ---------------------------------------------------------------------------------------------
# goodness of fit


def merge_small_bins(observed: np.ndarray, expected: np.ndarray,
                     min_expected: float = MIN_EXPECTED) -> tuple[np.ndarray, np.ndarray]:
    """observed [C] counts and expected [C] counts (same total) -> merged (O, E): bins expected
    to hold >= min_expected kept, the others lumped into one; a lump still under min_expected
    joins the smallest kept bin. May return a single bin (nothing to test)."""
    observed, expected = np.asarray(observed, dtype=np.float64), np.asarray(expected, dtype=np.float64)
    big = expected >= min_expected
    kept_o, kept_e = list(observed[big]), list(expected[big])
    lump_o, lump_e = float(observed[~big].sum()), float(expected[~big].sum())
    if lump_e >= min_expected or not kept_e:
        if lump_e > 0 or lump_o > 0:
            kept_o.append(lump_o)
            kept_e.append(lump_e)
    elif lump_e > 0 or lump_o > 0:
        smallest = int(np.argmin(kept_e))
        kept_o[smallest] += lump_o
        kept_e[smallest] += lump_e
    return np.array(kept_o), np.array(kept_e)


def g_statistic(observed: np.ndarray, expected: np.ndarray) -> float:
    """G = 2 sum O ln(O / E) over bins with O > 0; inf when a bin with E = 0 was observed."""
    seen = observed > 0
    if np.any(expected[seen] <= 0):
        return math.inf
    return float(2 * np.sum(observed[seen] * np.log(observed[seen] / expected[seen])))


@dataclass
class GofResult:
    """A pooled G-test: statistic, degrees of freedom, p-value (None: nothing testable, every
    group collapsed to one bin), samples and groups that took part."""

    statistic: float
    dof: int
    p_value: float | None
    num_samples: int
    num_groups: int


def pooled_gof(groups: Sequence[tuple[np.ndarray, np.ndarray]], min_expected: float = MIN_EXPECTED) -> GofResult:
    """groups: (counts [C], probs [C]) per group, probs summing to 1 over the same C bins. Each
    group is tested against its own exact distribution; the G statistics and degrees of freedom
    add up (independent groups)."""
    statistic, dof, num_samples, num_groups = 0.0, 0, 0, 0
    for counts, probs in groups:
        counts = np.asarray(counts, dtype=np.float64)
        n = counts.sum()
        observed, expected = merge_small_bins(counts, n * np.asarray(probs, dtype=np.float64), min_expected)
        if len(observed) < 2:
            continue
        statistic += g_statistic(observed, expected)
        dof += len(observed) - 1
        num_samples += int(n)
        num_groups += 1
    if dof == 0:
        return GofResult(0.0, 0, None, 0, 0)
    p_value = 0.0 if math.isinf(statistic) else chi2_sf(statistic, dof)
    return GofResult(statistic, dof, p_value, num_samples, num_groups)


def bonferroni(p_values: Sequence[float]) -> float:
    """The family's adjusted p-value: the smallest one times the number of tests, capped at 1."""
    return min(1.0, min(p_values) * len(p_values)) if p_values else 1.0


def distribution_bins(top_ids: Sequence[int], top_logprobs: Sequence[float]) -> tuple[list[int], np.ndarray]:
    """The top-n tokens of an exact distribution (processed logprobs) -> (ids [n'], probs
    [n' + 1]): their probabilities, then the mass of every other token ("rest"). -inf entries
    (outside the candidate set) are left out."""
    pairs = [(int(i), float(lp)) for i, lp in zip(top_ids, top_logprobs) if lp != -math.inf]
    probs = np.array([math.exp(lp) for _, lp in pairs])
    rest = max(0.0, 1.0 - float(probs.sum()))
    return [i for i, _ in pairs], np.append(probs, rest)


def bin_counts(tokens: Sequence[int], ids: Sequence[int]) -> np.ndarray:
    """Counts of tokens over the bins of `distribution_bins` (ids, then rest)."""
    index = {token_id: i for i, token_id in enumerate(ids)}
    counts = np.zeros(len(ids) + 1)
    for token in tokens:
        counts[index.get(token, len(ids))] += 1
    return counts


def same_token_bypass(probs: np.ndarray, draft_bin: int) -> np.ndarray:
    """The output distribution of a verifier that, besides the rejection rule, accepts a
    point-mass draft d whenever the target's own sample equals it: accepted with probability
    1 - (1 - q(d))^2 = q(d) (2 - q(d)) instead of q(d); a rejection draws from q without d, so
    every other token keeps its share of the remaining (1 - q(d))^2 mass, i.e. q(x) (1 - q(d)).
    probs [C] (q over bins), draft_bin: the bin of d."""
    q_draft = float(probs[draft_bin])
    biased = probs * (1 - q_draft)
    biased[draft_bin] = q_draft * (2 - q_draft)
    return biased


# ---------------------------------------------------------------------------------------------
# logprob identity


@dataclass
class LogprobEntry:
    """One position's logprobs in plain form: the token's own, top-n (id -> logprob) and the
    requested ids' (in request order)."""

    token_id: int
    logprob: float
    top: dict[int, float]
    requested: list[float]


def logprob_diff(a: float, b: float) -> float:
    """|a - b|, 0 when both are -inf, inf when only one is."""
    if a == -math.inf or b == -math.inf:
        return 0.0 if a == b else math.inf
    return abs(a - b)


def logprob_diffs(generated: LogprobEntry, scored: LogprobEntry, tolerance: float) -> tuple[float, int, list[str]]:
    """(max abs difference, values compared, problems) for one position. Top-n lists are
    compared id by id; an id in only one list is accepted when it ties, within tolerance, with
    the other list's last entry (a tie at the cut may fall either way)."""
    problems: list[str] = []
    diffs = [logprob_diff(generated.logprob, scored.logprob)]
    if generated.token_id != scored.token_id:
        problems.append(f"token {generated.token_id} scored as {scored.token_id}")
    top_a = {i: lp for i, lp in generated.top.items() if lp != -math.inf}
    top_b = {i: lp for i, lp in scored.top.items() if lp != -math.inf}
    diffs += [logprob_diff(top_a[i], top_b[i]) for i in top_a.keys() & top_b.keys()]
    for only, other in ((top_a.keys() - top_b.keys(), top_b), (top_b.keys() - top_a.keys(), top_a)):
        cut = min(other.values(), default=-math.inf)
        source = top_a if other is top_b else top_b
        for token_id in only:
            if logprob_diff(source[token_id], cut) > tolerance:
                problems.append(f"top id {token_id} in one list only")
    if len(generated.requested) != len(scored.requested):
        problems.append(f"{len(generated.requested)} requested logprobs against {len(scored.requested)}")
    diffs += [logprob_diff(a, b) for a, b in zip(generated.requested, scored.requested)]
    worst = max(diffs)
    if worst > tolerance:
        problems.append(f"logprob differs by {worst:.3g}")
    return worst, len(diffs), problems


# ---------------------------------------------------------------------------------------------
# the report


@dataclass
class CheckResult:
    """One row of the report. value: the p-value or max difference, as text; details: one
    dict per cell (JSON-ready); notes: why it failed, or what the reader should know."""

    name: str
    cells: int
    statistic: str
    value: str
    passed: bool
    details: list[dict] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)
    seconds: float = 0.0  # wall time of the check (shared with the next row for a check with two)

    def to_json(self) -> dict:
        return {"name": self.name, "cells": self.cells, "statistic": self.statistic, "value": self.value,
                "passed": self.passed, "seconds": round(self.seconds, 1), "notes": self.notes,
                "details": self.details}


COLUMNS = ("check", "cells", "statistic", "p-value / max diff", "time", "result")


def format_p(p_value: float | None) -> str:
    if p_value is None:
        return "-"
    return f"{p_value:.3g}" if p_value >= 1e-300 else "<1e-300"


def render_table(results: Sequence[CheckResult]) -> str:
    """A plain-text table, one row per check, then each failed check's notes."""
    rows = [COLUMNS] + [(r.name, str(r.cells), r.statistic, r.value, f"{r.seconds:.0f} s",
                         "pass" if r.passed else "FAIL") for r in results]
    widths = [max(len(row[i]) for row in rows) for i in range(len(COLUMNS))]
    lines = ["  ".join(cell.ljust(width) for cell, width in zip(row, widths)).rstrip() for row in rows]
    lines.insert(1, "  ".join("-" * width for width in widths))
    for result in results:
        lines += [f"{result.name}: {note}" for note in result.notes]
    passed = sum(r.passed for r in results)
    lines.append(f"{passed}/{len(results)} checks passed" + ("" if passed == len(results) else ": FAILED"))
    return "\n".join(lines)


def render_details(rows: Sequence[dict], columns: Sequence[str]) -> str:
    """A plain-text table of a check's cells (the keys in columns)."""
    table = [list(columns)] + [[str(row.get(c, "")) for c in columns] for row in rows]
    widths = [max(len(line[i]) for line in table) for i in range(len(columns))]
    return "\n".join("  ".join(cell.ljust(w) for cell, w in zip(line, widths)).rstrip() for line in table)


def plain_json(value):
    """value with every non-finite float made None (JSON has no inf or NaN)."""
    if isinstance(value, float) and not math.isfinite(value):
        return None
    if isinstance(value, dict):
        return {k: plain_json(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [plain_json(v) for v in value]
    return value


def report_json(results: Sequence[CheckResult], settings: dict) -> dict:
    """The report as plain JSON (an infinite statistic or difference is null)."""
    return plain_json({"passed": all(r.passed for r in results), "settings": settings,
                       "checks": [r.to_json() for r in results]})


def distribution_results(details: Sequence[dict], alpha: float, num_samples: int) -> list[CheckResult]:
    """The distribution row and the power row from per-cell details ("p": the cell's p-value,
    None when untestable; "bypass_p": the simulated bypass's, where simulated). Both use the
    Bonferroni factor of the cells tested; the power row passes when the bypass would fail."""
    tested = [d for d in details if d["p"] is not None]
    p_adjusted = bonferroni([d["p"] for d in tested])
    worst = min(tested, key=lambda d: d["p"], default=None)

    def where(d: dict) -> str:
        return f"context {d['context']} T={d['temperature']} draft {d['draft_mode']} position {d['position']}"

    notes = [f"{where(d)}: {d['outside_candidates']} sampled tokens outside the candidate set"
             for d in details if d["outside_candidates"]]
    if not tested:
        notes.append("no cell had enough samples sharing a prefix to test")
    elif p_adjusted < alpha:
        notes.append(f"worst cell: {where(worst)}, G={worst['G']} dof={worst['dof']} p={format_p(worst['p'])}")
    statistic = "-" if worst is None else f"worst G={worst['G']} dof={worst['dof']}, M={num_samples}"
    distribution = CheckResult("distribution", len(tested), statistic, f"p_adj={format_p(p_adjusted)}",
                               bool(tested) and p_adjusted >= alpha, list(details), notes)
    bypass = [d["bypass_p"] for d in details if d.get("bypass_p") is not None]
    factor = max(len(tested), 1)
    bypass_adjusted = min(1.0, min(bypass, default=1.0) * factor)
    caught = sum(p * factor < alpha for p in bypass)
    power_notes = [] if bypass_adjusted < alpha else [
        f"a verifier with the same-token bypass would pass at M={num_samples}: raise --samples"]
    power = CheckResult("power: same-token bypass (simulated)", len(bypass), f"{caught}/{len(bypass)} cells reject",
                        f"p_adj={format_p(bypass_adjusted)}", bypass_adjusted < alpha, [], power_notes)
    return [distribution, power]
