"""Statistics over the grid's results: means and spreads over seeds, mean evaluation
curves, samples to a target pass@1.

Imports: relayrl.experiments.staleness.runner (the result record).
"""

from __future__ import annotations

import statistics
from collections.abc import Sequence

from relayrl.experiments.staleness.runner import (
    CellResult,
)


def mean_std(values: Sequence[float]) -> tuple[float, float]:
    mean = statistics.fmean(values)
    return mean, statistics.stdev(values) if len(values) > 1 else 0.0


def fmt(values: Sequence[float], digits: int = 3, sign: bool = False) -> str:
    """``mean ± std`` (``mean`` alone for one value); ``sign``: always a sign on the mean."""
    mean, std = mean_std(values)
    head = f"{mean:{'+' if sign else ''}.{digits}f}"
    return f"{head} ± {std:.{digits}f}" if len(values) > 1 else head


def fmt_known(values: Sequence[float | None], digits: int = 3) -> str:
    known = [v for v in values if v is not None]
    return fmt(known, digits) if known else "n/a"


def paired(a: Sequence[CellResult], b: Sequence[CellResult]) -> list[float]:
    """Per-seed differences of final pass@1, ``a − b``, in seed order, over the seeds both
    cells have (same seed: same prompts and sampling seeds)."""
    other = {r.seed: r.final_pass for r in b}
    return [
        r.final_pass - other[r.seed] for r in sorted(a, key=lambda r: r.seed) if r.seed in other
    ]


def separable(values: Sequence[float]) -> bool:
    """A difference is told apart from noise only when |mean| > std over seeds (and there are
    at least two seeds to have a std)."""
    mean, std = mean_std(values)
    return len(values) > 1 and abs(mean) > std


def fmt_paired(values: Sequence[float]) -> str:
    """Signed ``mean ± std`` of paired differences, ``(not separable)`` when |mean| ≤ std;
    ``—`` when no seed pairs up."""
    if not values:
        return "—"
    return fmt(values, sign=True) + ("" if separable(values) else " (not separable)")


def group(results: Sequence[CellResult]) -> dict[tuple[str, int], list[CellResult]]:
    out: dict[tuple[str, int], list[CellResult]] = {}
    for r in sorted(results, key=lambda r: r.seed):
        out.setdefault((r.method, r.eta), []).append(r)
    return out


def mean_curve(runs: Sequence[CellResult]) -> list[tuple[int, float]]:
    """Seed-mean pass@1 at each evaluation point the runs share."""
    points: dict[int, list[float]] = {}
    for r in runs:
        for samples, p, _ in r.curve:
            points.setdefault(samples, []).append(p)
    return [(s, statistics.fmean(v)) for s, v in sorted(points.items()) if len(v) == len(runs)]


def samples_to_target(curve: Sequence[tuple[int, float]], target: float) -> int | None:
    """Generated samples at the first evaluation with pass@1 ≥ target (None if never)."""
    return next((s for s, p in curve if p >= target), None)


def default_target(
    cells: dict[tuple[str, int], list[CellResult]], etas: Sequence[int]
) -> float | None:
    """Halfway from the base (step-0 pass@1) to the best seed-mean final pass@1 of the D-ARL
    comparison; None when nothing improved on the base."""
    runs = [r for (m, eta), rs in cells.items() if eta in etas for r in rs]
    if not runs:
        return None
    base = statistics.fmean(r.curve[0][1] for r in runs)
    best = max(
        statistics.fmean(r.final_pass for r in rs) for (m, eta), rs in cells.items() if eta in etas
    )
    return base + 0.5 * (best - base) if best > base + 0.01 else None


def _mean_pass(runs: Sequence[CellResult]) -> float:
    return statistics.fmean(r.final_pass for r in runs)
