"""Time to target over seeds for ``relayrl bench trl``: the target every run reaches, each
side's mean ± std, the ratio of means, and the percentiles of completion lengths.

Owns the target rule. A *run* is one side at one seed; its evaluation curve is a list of
``(step, eval-free seconds, pass@1)`` with the base model's evaluation at step 0. The default
rule puts the target a fixed fraction of the way from the base pass@1 (the mean of every
run's step-0 evaluation) to the *worst run's best* pass@1 after step 0, so every run of every
side reaches it; ``--target`` gives a fixed target instead, which a run may miss (its total
time is then a lower bound). Pure functions; no torch, no TRL.
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Sequence
from dataclasses import dataclass

from relayrl.errors import RelayError

Curve = Sequence[tuple[int, float, float]]  # (step, eval-free seconds, pass@1)


@dataclass(frozen=True)
class Target:
    """The pass@1 every side is timed to, and how it was chosen."""

    value: float
    rule: str
    base: float | None = None  # mean step-0 pass@1 of every run (common rule only)
    worst_best: float | None = None  # lowest of the runs' best pass@1 after step 0
    improved: bool = True  # False: some run never beat the base, the time measures nothing
    # the base's binomial standard error on the evaluation's problems (common rule, when the
    # number of problems is known); a worst best within it is not a measured improvement
    base_stderr: float | None = None

    @property
    def within_noise(self) -> bool:
        """True when the worst run's best beat the base by no more than one standard error:
        every side then reaches the target by the evaluation's noise, and the time to it is
        the time to the first evaluations, not to learning."""
        if self.base is None or self.worst_best is None or self.base_stderr is None:
            return False
        return self.worst_best - self.base <= self.base_stderr


def fixed_target(value: float) -> Target:
    return Target(value, f"fixed target pass@1 {value:g} (--target); a run may not reach it")


def common_target(curves: Sequence[Curve], fraction: float, problems: int | None = None) -> Target:
    """``min(worst_best, base + fraction · (worst_best − base))``: reached by every run,
    since each run's best is ≥ the worst run's best (and ``fraction`` ≤ 1). ``problems``:
    the evaluation's number of problems, for the base's standard error
    (:attr:`Target.within_noise`)."""
    if not 0 < fraction <= 1:
        raise RelayError(f"--target-fraction must be in (0, 1] (got {fraction})")
    bests = []
    for i, curve in enumerate(curves):
        after = [p for step, _, p in curve if step > 0]
        if not after:
            raise RelayError(f"run {i} has no held-out evaluation after step 0")
        bests.append(max(after))
    if not bests:
        raise RelayError("no run to set a target from")
    worst_best = min(bests)
    starts = [p for curve in curves for step, _, p in curve if step == 0]
    if not starts:
        return Target(worst_best, "the worst run's best pass@1 (no step-0 evaluation)", None)
    base = statistics.fmean(starts)
    value = min(worst_best, base + fraction * (worst_best - base))
    rule = (
        f"{fraction:g} of the way from the base pass@1 {base:.3f} (mean of every run's step-0 "
        f"evaluation) to the worst run's best pass@1 {worst_best:.3f}: target {value:.3f}, "
        "reached by every run of every side"
    )
    stderr = math.sqrt(base * (1 - base) / problems) if problems else None
    return Target(value, rule, base, worst_best, improved=worst_best > base, base_stderr=stderr)


def time_to_target(curve: Curve, total_seconds: float, target: float) -> tuple[float, bool]:
    """(eval-free seconds at the first evaluation after step 0 with pass@1 ≥ target, True);
    (total seconds, False) when none reached it. Step 0 (the base model) does not count."""
    for step, elapsed, p in curve:
        if step > 0 and p >= target:
            return elapsed, True
    return total_seconds, False


def crossing_midpoint(curve: Curve, target: float) -> float | None:
    """The midpoint of the interval in which pass@1 crossed ``target``: between the last
    evaluation below it and the first at or above it (after step 0); None if never reached.
    Evaluations every k steps put a run's time to target at the end of that interval, which
    inflates a slow side (wide intervals) more than a fast one; the midpoint halves that."""
    before = 0.0
    for step, elapsed, p in curve:
        if step > 0 and p >= target:
            return (before + elapsed) / 2
        before = elapsed
    return None


@dataclass(frozen=True)
class Spread:
    """Mean and sample standard deviation (n − 1; 0 for one value) over seeds."""

    mean: float
    std: float
    n: int

    def __str__(self) -> str:
        return f"{self.mean:.1f} ± {self.std:.1f}"


def spread(values: Sequence[float]) -> Spread:
    if not values:
        raise ValueError("spread of no values")
    std = statistics.stdev(values) if len(values) > 1 else 0.0
    return Spread(statistics.fmean(values), std, len(values))


@dataclass(frozen=True)
class SideSummary:
    """One side over its seeds: time to target and trained samples per second."""

    side: str
    seeds: tuple[int, ...]
    time_to_target: Spread
    samples_per_s: Spread
    reached_all: bool  # False: some seed missed a fixed target; its total time is in the mean


def summarize(side: str, runs: Sequence[tuple[int, float, bool, float]]) -> SideSummary:
    """``runs``: (seed, time to target, reached, samples/s) of each seed of one side."""
    return SideSummary(
        side,
        tuple(seed for seed, *_ in runs),
        spread([t for _, t, _, _ in runs]),
        spread([sps for *_, sps in runs]),
        all(reached for _, _, reached, _ in runs),
    )


def compare(trl: tuple[float, bool], relay: tuple[float, bool]) -> tuple[float, str, str]:
    """(TRL time / relayrl time, its bound sign, a note). A side that never reached the
    target contributes its total time, a lower bound of its time to target."""
    ratio = trl[0] / max(relay[0], 1e-9)
    if trl[1] and relay[1]:
        return ratio, "", ""
    if not trl[1] and relay[1]:
        return ratio, ">", "TRL did not reach the target: its total time is a lower bound"
    if trl[1] and not relay[1]:
        return ratio, "<", "relayrl did not reach the target: its total time is a lower bound"
    return ratio, "?", "neither side reached the target: the ratio of total times, no bound"


def ratio_of_means(trl: SideSummary, relay: SideSummary) -> tuple[float, str, str]:
    """TRL's mean time to target / relayrl's, with :func:`compare`'s bound sign and note."""
    return compare(
        (trl.time_to_target.mean, trl.reached_all), (relay.time_to_target.mean, relay.reached_all)
    )


def percentiles(lengths: Sequence[int]) -> dict[str, int]:
    """p50, p90 (nearest rank: the ⌈q·n⌉-th smallest) and max of token lengths."""
    if not lengths:
        raise ValueError("percentiles of no lengths")
    ordered = sorted(lengths)

    def rank(q: float) -> int:
        return ordered[max(1, math.ceil(q * len(ordered))) - 1]

    return {"p50": rank(0.5), "p90": rank(0.9), "max": ordered[-1]}
