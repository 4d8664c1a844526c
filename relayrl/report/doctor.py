"""The report's findings: the mismatch doctor and the other warnings and failures of a run.

Owns: :class:`Finding`, :data:`MISMATCH_THRESHOLD`, :func:`mismatch_threshold`,
:func:`mismatch_levels`,
:func:`fresh_mismatch` (per step, the engine-vs-trainer mismatch on fresh tokens),
:func:`mismatch_finding` and :func:`run_findings` (every finding of a run, in the order
the report shows them).

The mismatch doctor reads the trainer's ``mismatch_kl_k3_s<s>`` columns: the k3 estimate
of KL(μ ‖ π_v) over the step's tokens of staleness s (``relayrl.algo.losses.
mismatch_by_staleness``). Tokens of staleness 0 were sampled by the very weights the
trainer holds, so their KL is numerics alone (about 1e-13 for the built-in engine in fp32);
above :data:`MISMATCH_THRESHOLD` something other than staleness makes the engine and the
trainer disagree. A run that rounds to 16 bits on purpose (bf16 rollout weights or bf16
autocast in the trainer) measures ~2e-3 from the rounding alone, so its threshold is
:data:`LOW_PRECISION_MISMATCH_THRESHOLD` (:func:`mismatch_threshold`). Runs logged before those columns existed fall back on
``engine_trainer_kl_k3`` (the same quantity, on the tokens of the trainer's version).

Imports: the standard library, relayrl.metric_names and relayrl.report.logs.
"""

from __future__ import annotations

import statistics
from dataclasses import dataclass

from relayrl.metric_names import (
    ENGINE_TRAINER_KL,
    FINAL,
    MISMATCH_KL,
    MISMATCH_TOKENS,
    REWARD_MEAN,
    STEP,
)
from relayrl.report.logs import RunLogs

# fresh-token KL(μ ‖ π_v) in nats per token above which numerics are not the explanation:
# fp32 on both sides measures ~1e-11 (SmolLM2-135M) down to ~1e-13 (the demo model); a bf16
# server or bf16 autocast ~2e-3 on SmolLM2-135M (docs/real-model.md)
MISMATCH_THRESHOLD = 1e-3
LOW_PRECISION_MISMATCH_THRESHOLD = 1e-2
LOW_PRECISION = ("bfloat16", "float16", "bf16", "fp16")
MIN_TOKENS = 8  # a level averaged over fewer tokens is too noisy to warn on
TRUNCATED_WARN = 0.5  # share of a run's samples cut at the token budget
GRADING_ERRORS_WARN = 0.05  # share of a run's samples whose grading failed

CAUSES = (
    "a dtype difference between the rollout engine and the trainer (rollout.dtype, "
    "model.dtype, train.mixed_precision)",
    "a kernel that computes the logits differently (attention, matmul or sampling "
    "implementation of the engine, e.g. vLLM's, against the trainer's)",
    "a missed weight load: a server generating with older weights than the version it "
    "tags its tokens with (a failed or partial publication)",
    "a prefix or KV cache reused across weight versions (train.publish_mode=inflight, an "
    "engine's prefix caching)",
    "a temperature or token-alignment mismatch (the engine's logprobs of other tokens)",
)


@dataclass
class Finding:
    """One section of the report: ``kind`` is ``failure`` or ``warning``; ``detail`` and
    ``items`` are plain text (the report escapes them)."""

    kind: str
    title: str
    detail: str
    items: tuple[str, ...] = ()


def _training_rows(logs: RunLogs) -> list[dict]:
    return [m for m in logs.metrics if REWARD_MEAN in m and not m.get(FINAL)]


def mismatch_levels(logs: RunLogs) -> list[int]:
    """The staleness levels s that some step logged ``mismatch_kl_k3_s<s>`` for."""
    levels = set()
    for row in logs.metrics:
        for key in row:
            suffix = key[len(MISMATCH_KL) :]
            if key.startswith(MISMATCH_KL) and suffix.isdigit():
                levels.add(int(suffix))
    return sorted(levels)


def fresh_mismatch(logs: RunLogs) -> list[tuple[int, float]]:
    """``(step, KL)``: the fresh tokens' engine-vs-trainer KL of each step that measured it
    on at least :data:`MIN_TOKENS` tokens (``engine_trainer_kl_k3`` for older runs)."""
    out = []
    for row in _training_rows(logs):
        value = row.get(f"{MISMATCH_KL}0")
        tokens = row.get(f"{MISMATCH_TOKENS}0", MIN_TOKENS)
        if value is None:
            value, tokens = row.get(ENGINE_TRAINER_KL), row.get("engine_trainer_kl_tokens", 0)
        if value is not None and tokens >= MIN_TOKENS:
            out.append((int(row[STEP]), float(value)))
    return out


def _stale_median(logs: RunLogs, level: int) -> float | None:
    values = [
        float(r[f"{MISMATCH_KL}{level}"])
        for r in _training_rows(logs)
        if f"{MISMATCH_KL}{level}" in r
    ]
    return statistics.median(values) if values else None


def mismatch_threshold(config: dict | None) -> float:
    """The doctor's threshold for a run with this (resolved) config: the low-precision one
    when the rollout weights (``rollout.dtype``, else ``model.dtype``) or the trainer's
    compute (``model.dtype``, ``train.mixed_precision``) are 16-bit, else
    :data:`MISMATCH_THRESHOLD`."""
    config = config or {}
    model, rollout, train = (config.get(k) or {} for k in ("model", "rollout", "train"))
    settings = (model.get("dtype"), rollout.get("dtype"), train.get("mixed_precision"))
    if any(value in LOW_PRECISION for value in settings):
        return LOW_PRECISION_MISMATCH_THRESHOLD
    return MISMATCH_THRESHOLD


def mismatch_finding(
    logs: RunLogs, config: dict | None = None, threshold: float | None = None
) -> Finding | None:
    """A warning when some step's fresh-token mismatch exceeds ``threshold`` (default: the
    run's, :func:`mismatch_threshold`); None when every step stays below it or none
    measured it."""
    if threshold is None:
        threshold = mismatch_threshold(config)
    fresh = fresh_mismatch(logs)
    high = [(s, v) for s, v in fresh if v > threshold]
    if not high:
        return None
    worst_step, worst = max(high, key=lambda sv: sv[1])
    median = statistics.median(v for _, v in fresh)
    detail = (
        f"On {len(high)} of {len(fresh)} steps the tokens of staleness 0 — sampled by the very "
        f"weights the trainer held — had KL(μ ‖ π_v) above {threshold:g} nats per token "
        f"(median over the steps {median:.2e}, worst {worst:.2e} at step {worst_step}). "
        "Staleness cannot explain a gap on fresh tokens: the rollout engine and the trainer "
        "compute different probabilities from the same weights."
    )
    stale = _stale_median(logs, 1)
    if stale is not None:
        detail += f" For comparison, tokens one version old: median KL {stale:.2e}."
    rollout = (config or {}).get("rollout") or {}
    if rollout.get("dtype") not in (None, (config or {}).get("model", {}).get("dtype")):
        detail += (
            f" This run sets rollout.dtype={rollout['dtype']}: the rounding of the rollout "
            "weights alone gives a gap of this order."
        )
    return Finding("warning", "engine-vs-trainer mismatch on fresh tokens", detail, CAUSES)


def _share(samples: list[dict], test) -> float:
    return sum(1 for s in samples if test(s)) / len(samples) if samples else 0.0


def sample_findings(logs: RunLogs) -> list[Finding]:
    """Truncation and grading errors over the run's trained samples."""
    out = []
    truncated = _share(logs.samples, lambda s: s.get("finish_reason") == "length")
    if truncated > TRUNCATED_WARN:
        out.append(
            Finding(
                "warning",
                "most samples were truncated",
                f"{truncated:.0%} of the trained samples stopped at rollout.max_new_tokens: "
                "their reward grades an unfinished answer. Raise rollout.max_new_tokens or "
                "compare completed_correct_frac with reward_mean.",
            )
        )
    errors = _share(logs.samples, lambda s: s.get("reward_status", "ok") != "ok")
    if errors > GRADING_ERRORS_WARN:
        out.append(
            Finding(
                "warning",
                "grading errors",
                f"{errors:.0%} of the trained samples were not graded cleanly (reward_status "
                "other than ok: a grader error or timeout, rewarded 0); see the grader's "
                "messages in the run's output.",
            )
        )
    return out


def progress_finding(logs: RunLogs, config: dict | None, finished: bool) -> Finding | None:
    """A failure when the run stopped before its last step (or is still running)."""
    steps = _training_rows(logs)
    total = ((config or {}).get("train") or {}).get("total_steps")
    done = int(steps[-1][STEP]) if steps else 0
    if finished or total is None or done >= total:
        return None
    return Finding(
        "failure",
        "the run has not finished",
        f"{done} of {total} steps are logged and the run wrote no train_summary.json: it is "
        "still going, or it stopped (killed, or an error: see its output and server-*.log). "
        "`relayrl train --resume RUN_DIR` continues from its newest checkpoint.",
    )


def run_findings(logs: RunLogs, config: dict | None, finished: bool) -> list[Finding]:
    """Every finding of a run: failures first, then warnings."""
    found = [progress_finding(logs, config, finished), mismatch_finding(logs, config)]
    found += sample_findings(logs)
    return sorted((f for f in found if f is not None), key=lambda f: f.kind != "failure")
