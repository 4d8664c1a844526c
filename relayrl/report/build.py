"""Build ``<run>/report/index.html`` and one PNG per chart from a run directory.

Every chart is optional: a chart whose metrics a run did not log (an SFT-only run, a run
without replay, an older version) is listed as skipped instead of failing the report.
"""

from __future__ import annotations

import base64
import html
import re
from collections.abc import Callable
from dataclasses import dataclass, field
from functools import partial
from pathlib import Path

from relayrl.metric_names import (
    BEHAV_PROX_KL,
    CLIP_FRAC,
    COMPLETED_CORRECT,
    DRIFT_KL,
    ELAPSED_S,
    ESS_FRAC,
    ETA,
    EVAL_PASS_AT_1,
    EVAL_PROBLEMS,
    EVAL_VERSION,
    GEN_TOKENS_PER_S,
    IS_WEIGHT_MEAN,
    MISMATCH_KL,
    PASS_RATE,
    REWARD_MEAN,
    STALENESS_MAX,
    STALENESS_MEAN,
    STEP,
    TIME_DRIFT_S,
    TIME_PROX_S,
    TIME_SYNC_S,
    TIME_UPDATE_S,
    TIME_WAIT_S,
    TRAIN_TOKENS_PER_S,
    VERSION,
)
from relayrl.report.doctor import (
    MISMATCH_THRESHOLD,
    Finding,
    mismatch_levels,
    mismatch_threshold,
    run_findings,
)
from relayrl.report.inspect import PAGE, build_inspector
from relayrl.report.logs import RunLogs, load_run
from relayrl.report.summary import read_config, step_rows, summary_rows

# D-ARL metrics, charted by key prefix whatever versions they name: the replay buffer's
# kept fraction and size per behaviour version (relayrl.algo.darl logs select/kept_frac/v<k>,
# relayrl.buffer.replay buffer/count/v<k>) and the multi-behaviour weights α_k.
REPLAY_PREFIXES = ("replay_kept_fraction", "replay_count")  # train/replay_step.py's keys
ALPHA_PREFIXES = ("darl_alpha",)
MAX_LEGEND = 12  # legend entries of a chart (a run may log one series per version)
TIME_SPLIT = [
    (TIME_WAIT_S, "waiting for data"),
    (TIME_PROX_S, "proximal pass"),
    (TIME_UPDATE_S, "update"),
    (TIME_DRIFT_S, "drift metrics"),
    (TIME_SYNC_S, "weight sync"),
]


@dataclass
class Report:
    html_path: Path
    charts: dict[str, Path] = field(default_factory=dict)
    skipped: dict[str, str] = field(default_factory=dict)


# ---------------------------------------------------------------- charts
def _lines(ax, logs: RunLogs, keys: list[tuple[str, str]], x: str) -> bool:
    drawn = False
    for key, label in keys:
        xs, ys = logs.series(key, x)
        if xs:
            ax.plot(xs, ys, label=label, marker="." if len(xs) < 40 else None)
            drawn = True
    if drawn:
        ax.legend(loc="best", fontsize=8)
    return drawn


REWARD_SERIES = [
    (REWARD_MEAN, "train reward"),
    (COMPLETED_CORRECT, "completed correct (finished and passed)"),
    (EVAL_PASS_AT_1, "held-out pass@1"),
]


def chart_reward(ax, logs: RunLogs) -> bool:
    ax.set(
        title="reward and held-out pass@1 by step", xlabel="step", ylabel="mean reward / fraction"
    )
    return _lines(ax, logs, REWARD_SERIES, STEP)


def chart_reward_time(ax, logs: RunLogs) -> bool:
    ax.set(
        title="reward and held-out pass@1 by wall-clock",
        xlabel="wall-clock seconds",
        ylabel="mean reward / fraction",
    )
    return _lines(ax, logs, REWARD_SERIES, ELAPSED_S)


def chart_mismatch(ax, logs: RunLogs, threshold: float = MISMATCH_THRESHOLD) -> bool:
    """The mismatch doctor: KL(μ ‖ π_v) per token staleness, fresh tokens (the
    engine-vs-trainer mismatch) apart from the drift of stale ones, and the run's warning
    line (``threshold``)."""
    levels = mismatch_levels(logs)
    if not levels:
        return False
    for level in levels:
        xs, ys = logs.series(f"{MISMATCH_KL}{level}")
        label = "fresh tokens (s = 0): engine vs trainer" if level == 0 else f"s = {level}"
        ax.plot(xs, [max(y, 1e-18) for y in ys], label=label, marker="." if len(xs) < 40 else None)
    ax.axhline(threshold, color="red", linestyle=":", label="doctor's threshold")
    ax.set_yscale("log")
    ax.set(
        title="mismatch doctor: KL(μ ‖ π_v) by token staleness s",
        xlabel="step",
        ylabel="k3 KL (nats / token)",
    )
    ax.legend(loc="best", fontsize=7)
    return True


def chart_lengths(ax, logs: RunLogs) -> bool:
    by_step: dict[int, list[int]] = {}
    for s in logs.samples:
        if "completion_tokens" in s and "step" in s:
            by_step.setdefault(s["step"] + 1, []).append(s["completion_tokens"])
    if not by_step:
        return False
    steps = sorted(by_step)
    shown = steps[:: max(1, len(steps) // 8)]  # at most ~8 boxes
    ax.boxplot([by_step[s] for s in shown], positions=shown, widths=0.6, showfliers=True)
    ax.set(title="response length distribution over steps", xlabel="step", ylabel="tokens")
    return True


def chart_staleness(ax, logs: RunLogs) -> bool:
    values = [
        s["trainer_version"] - s["version_min"]
        for s in logs.samples
        if "trainer_version" in s and "version_min" in s
    ]
    if not values:
        return False
    ax.hist(values, bins=range(0, max(values) + 2), align="left", rwidth=0.8)
    ax.set(
        title="staleness of trained samples",
        xlabel="trainer version − oldest token version",
        ylabel="samples",
    )
    return True


def chart_staleness_bound(ax, logs: RunLogs) -> bool:
    """The bound η per step (``rollout.eta=auto`` moves it) against the staleness trained."""
    ax.set(title="staleness bound η and trained staleness by step", xlabel="step")
    keys = [(ETA, "bound η"), (STALENESS_MAX, "max staleness"), (STALENESS_MEAN, "mean staleness")]
    if not logs.series(ETA, STEP)[0]:
        return False
    return _lines(ax, logs, keys, STEP)


def chart_importance(ax, logs: RunLogs) -> bool:
    ax.set(title="importance weights π_prox/μ", xlabel="step", ylabel="weight / fraction")
    return _lines(
        ax,
        logs,
        [
            (IS_WEIGHT_MEAN, "mean"),
            ("is_weight_max", "max"),
            (CLIP_FRAC, "fraction clipped"),
            ("is_masked_frac", "fraction masked"),
            ("is_truncated_frac", "fraction truncated"),
        ],
        STEP,
    )


def chart_drift(ax, logs: RunLogs) -> bool:
    ax.set(title="per-version drift (k3, batch tokens)", xlabel="step", ylabel="KL (nats / token)")
    return _lines(
        ax,
        logs,
        [(DRIFT_KL, "KL(π_v ‖ π_v+1)"), (BEHAV_PROX_KL, "KL(μ ‖ π_v)")],
        STEP,
    )


def chart_ess(ax, logs: RunLogs) -> bool:
    ax.set(title="effective sample size of π_prox/μ", xlabel="step", ylabel="ESS / N")
    return _lines(ax, logs, [(ESS_FRAC, "ESS / N")], STEP)


def natural_key(key: str) -> list:
    """``v2`` before ``v10``."""
    return [int(p) if p.isdigit() else p for p in re.split(r"(\d+)", key)]


def prefixed_keys(logs: RunLogs, prefixes: tuple[str, ...]) -> list[str]:
    """Numeric metric keys starting with any of ``prefixes``, in natural order."""
    keys = {
        k
        for m in logs.metrics
        for k, v in m.items()
        if k.startswith(prefixes) and isinstance(v, (int, float)) and not isinstance(v, bool)
    }
    return sorted(keys, key=natural_key)


def series_colors(n: int) -> list:
    """Distinct colours for up to 10 series, else an old → new gradient (one per version)."""
    if n <= 10:
        return [f"C{i}" for i in range(n)]
    from matplotlib import colormaps

    return [colormaps["viridis"](i / (n - 1)) for i in range(n)]


def chart_prefixed(ax, logs: RunLogs, prefixes: tuple[str, ...], title: str) -> bool:
    """Every metric whose key starts with one of ``prefixes``, against step. Series that stay
    within [0, 1] (fractions, weights) use the left axis, the others (counts, sizes) the right
    one, dashed. The legend lists the first and last ``MAX_LEGEND / 2`` series."""
    keys = prefixed_keys(logs, prefixes)
    if not keys:
        return False
    unit = {k for k in keys if all(0 <= y <= 1 for y in logs.series(k)[1])}
    ax.set(title=title, xlabel="step", ylabel="fraction" if unit else None)
    right = ax.twinx() if unit and len(unit) < len(keys) else ax
    for key, color in zip(keys, series_colors(len(keys)), strict=True):
        xs, ys = logs.series(key)
        axis, style = (ax, "-") if key in unit else (right, "--")
        axis.plot(xs, ys, style, color=color, label=key, marker="." if len(xs) < 40 else None)
    handles = ax.get_legend_handles_labels()[0]
    if right is not ax:
        handles += right.get_legend_handles_labels()[0]
    if len(handles) > MAX_LEGEND:
        from matplotlib.lines import Line2D

        half = MAX_LEGEND // 2
        more = Line2D([], [], linestyle="", label=f"… {len(handles) - 2 * half} more")
        handles = handles[:half] + [more] + handles[-half:]
    ax.legend(handles=handles, loc="best", fontsize=7)
    return True


def chart_time_split(ax, logs: RunLogs) -> bool:
    present = [(k, label) for k, label in TIME_SPLIT if logs.has(k)]
    if not present:
        return False
    rows = [m for m in logs.metrics if STEP in m and any(k in m for k, _ in present)]
    steps = [m[STEP] for m in rows]
    bottom = [0.0] * len(steps)
    for key, label in present:
        values = [float(m.get(key) or 0.0) for m in rows]
        ax.bar(steps, values, bottom=bottom, label=label)
        bottom = [b + v for b, v in zip(bottom, values, strict=True)]
    ax.set(title="time per step", xlabel="step", ylabel="seconds")
    ax.legend(loc="best", fontsize=8)
    return True


def chart_throughput(ax, logs: RunLogs) -> bool:
    ax.set(title="throughput", xlabel="step", ylabel="tokens / s")
    return _lines(
        ax, logs, [(GEN_TOKENS_PER_S, "generation"), (TRAIN_TOKENS_PER_S, "training")], STEP
    )


def chart_episodes(ax, logs: RunLogs) -> bool:
    """Multi-turn runs: tool-call rate and turns per episode, in training and held out."""
    ax.set(
        title="episodes: tool-call rate and turns per episode",
        xlabel="step",
        ylabel="rate / turns",
    )
    return _lines(
        ax,
        logs,
        [
            ("episode_tool_calls_rate", "tool-call rate (train)"),
            ("eval_episode_tool_calls_rate", "tool-call rate (held out)"),
            ("episode_turns", "turns per episode (train)"),
            ("eval_episode_turns", "turns per episode (held out)"),
        ],
        STEP,
    )


CHARTS: dict[str, Callable] = {
    "reward_by_step": chart_reward,
    "reward_by_time": chart_reward_time,
    "response_length": chart_lengths,
    "staleness": chart_staleness,
    "staleness_bound": chart_staleness_bound,
    "importance_weights": chart_importance,
    "mismatch": chart_mismatch,
    "drift": chart_drift,
    "ess": chart_ess,
    "replay": partial(
        chart_prefixed,
        prefixes=REPLAY_PREFIXES,
        title="D-ARL replay: kept fraction per behaviour version",
    ),
    "darl_alpha": partial(
        chart_prefixed,
        prefixes=ALPHA_PREFIXES,
        title="D-ARL policy weights α_k = ESS_k / Σ_j ESS_j",
    ),
    "time_split": chart_time_split,
    "throughput": chart_throughput,
    "episodes": chart_episodes,
}


def draw_charts(
    logs: RunLogs, out_dir: Path, config: dict | None = None
) -> tuple[dict[str, Path], dict[str, str]]:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.ticker import MaxNLocator

    charts, skipped = {}, {}
    drawers = {**CHARTS, "mismatch": partial(chart_mismatch, threshold=mismatch_threshold(config))}
    for name, draw in drawers.items():
        fig, ax = plt.subplots(figsize=(6.4, 3.6), dpi=100)
        try:
            if draw(ax, logs):
                if ax.get_xlabel() == "step":
                    ax.xaxis.set_major_locator(MaxNLocator(integer=True))
                ax.grid(alpha=0.3)
                fig.tight_layout()
                charts[name] = out_dir / f"{name}.png"
                fig.savefig(charts[name])
            else:
                skipped[name] = "the run did not log the metrics this chart needs"
        finally:
            plt.close(fig)
    return charts, skipped


# ---------------------------------------------------------------- trajectories
TEXT_MISSING = (
    "Completion text was not recorded for this run (train.log_text=false): the tables show "
    "rewards, advantages and lengths only. Set train.log_text=true to see the text."
)


def extreme_samples(
    logs: RunLogs, steps: int = 3, per_step: int = 2
) -> list[tuple[int, list[tuple[str, dict]]]]:
    """``(step, [(label, sample), ...])``: the ``per_step`` best and worst trajectories (by
    reward, then advantage) at ``steps`` steps spread over the run, best first."""
    by_step: dict[int, list[dict]] = {}
    for s in logs.samples:
        by_step.setdefault(s.get("step", 0), []).append(s)
    if not by_step:
        return []
    ordered = sorted(by_step)
    picks = sorted(
        {ordered[round(i * (len(ordered) - 1) / max(1, steps - 1))] for i in range(steps)}
    )
    out = []
    for step in picks:
        rows = sorted(
            by_step[step], key=lambda s: (s.get("reward", 0), s.get("advantage", 0)), reverse=True
        )
        if len(rows) <= 2 * per_step:
            chosen = [("best" if i < len(rows) / 2 else "worst", r) for i, r in enumerate(rows)]
        else:
            chosen = [("best", r) for r in rows[:per_step]]
            chosen += [("worst", r) for r in rows[-per_step:]]
        out.append((step, chosen))
    return out


def _cell(value, fmt: str = "{}") -> str:
    return "" if value is None else html.escape(fmt.format(value))


def _sample_row(label: str, s: dict) -> str:
    text = s.get("text")
    stale = None
    if "trainer_version" in s and "version_min" in s:
        stale = s["trainer_version"] - s["version_min"]
    cells = [
        label,
        _cell(s.get("reward"), "{:.3g}"),
        _cell(s.get("advantage"), "{:+.3f}"),
        _cell(stale),
        _cell(s.get("completion_tokens")),
        _cell(s.get("finish_reason")),
        _cell(s.get("prompt_id")),
    ]
    body = "".join(f"<td>{c}</td>" for c in cells)
    texts = ""
    if s.get("prompt_text") is not None:
        texts += f"<pre class='prompt'>{html.escape(s['prompt_text'])}</pre>"
    texts += "<pre>" + (html.escape(text) if text is not None else "—") + "</pre>"
    return f"<tr>{body}<td>{texts}</td></tr>"


def render_samples(logs: RunLogs) -> list[str]:
    """The best/worst trajectory tables (steps shown 1-based, as in metrics.jsonl)."""
    parts = ["<h2>Best and worst sampled trajectories</h2>"]
    picked = extreme_samples(logs)
    if not picked:
        return parts + ["<p>No samples were logged (samples.jsonl is empty or missing).</p>"]
    if not any(s.get("text") is not None for _, rows in picked for _, s in rows):
        parts.append(f"<p class='note'>{TEXT_MISSING}</p>")
    header = "".join(
        f"<th>{h}</th>"
        for h in ("", "reward", "advantage", "staleness", "tokens", "finish", "prompt id", "text")
    )
    for step, rows in picked:
        parts.append(f"<h3>step {step + 1}</h3><table><tr>{header}</tr>")
        parts.extend(_sample_row(label, s) for label, s in rows)
        parts.append("</table>")
    return parts


SUMMARY_KEYS = (STEP, VERSION, REWARD_MEAN, PASS_RATE, STALENESS_MEAN, ELAPSED_S)


def training_rows(logs: RunLogs) -> list[dict]:
    """The metrics rows of optimizer steps (evaluation-only rows left out)."""
    return [m for m in logs.metrics if REWARD_MEAN in m]


def run_summary(logs: RunLogs) -> dict:
    """The last training step's headline numbers and the latest held-out evaluation."""
    steps = training_rows(logs)
    last = steps[-1] if steps else {}
    summary = {k: last[k] for k in SUMMARY_KEYS if k in last}
    evals = [m for m in logs.metrics if EVAL_PASS_AT_1 in m]
    if evals:
        summary[EVAL_PASS_AT_1] = evals[-1][EVAL_PASS_AT_1]
        summary[EVAL_VERSION] = evals[-1].get(EVAL_VERSION, evals[-1].get(VERSION))
        summary[EVAL_PROBLEMS] = evals[-1].get(EVAL_PROBLEMS)
    return summary


STYLE = (
    "body{font-family:sans-serif;max-width:1400px;margin:auto;padding:0 12px;color:#222}"
    "img{max-width:48%;margin:4px}pre{white-space:pre-wrap;margin:0}pre.prompt{color:#666}"
    ".note{color:#a60}td,th{vertical-align:top;border-top:1px solid #ddd;padding:4px;"
    "text-align:left}table.summary td:first-child{color:#555;padding-right:24px}"
    "table.steps td{text-align:right;font-variant-numeric:tabular-nums}"
    ".finding{border-left:5px solid #e0a000;background:#fff8e6;padding:6px 12px;margin:8px 0}"
    ".finding.failure{border-color:#c00;background:#fdecec}.ok{color:#070}"
)


def render_table(rows: list[tuple[str, str]]) -> str:
    body = "".join(f"<tr><td>{html.escape(k)}</td><td>{html.escape(v)}</td></tr>" for k, v in rows)
    return f"<table class='summary'>{body}</table>"


def render_findings(findings: list[Finding]) -> list[str]:
    """One section per failure or warning of the run."""
    parts = ["<h2>Failures and warnings</h2>"]
    if not findings:
        return parts + ["<p class='ok'>None: the run logged nothing the report checks for.</p>"]
    for f in findings:
        items = "".join(f"<li>{html.escape(i)}</li>" for i in f.items)
        more = f"<p>Likely causes:</p><ul>{items}</ul>" if items else ""
        parts.append(
            f"<section class='finding {f.kind}'><h3>{f.kind}: {html.escape(f.title)}</h3>"
            f"<p>{html.escape(f.detail)}</p>{more}</section>"
        )
    return parts


def render_steps(steps: list[dict]) -> list[str]:
    """The per-step table; each step links to its groups in the inspector."""
    titles, rows = step_rows(steps)
    if not rows:
        return []
    head = "".join(f"<th>{html.escape(t)}</th>" for t in ["step", *titles])
    body = "".join(
        f"<tr><td><a href='{PAGE}#step={step}'>step {step}</a></td>"
        + "".join(f"<td>{html.escape(c)}</td>" for c in cells)
        + "</tr>"
        for step, cells in rows
    )
    return [
        "<h2>Steps</h2><p>Each step links to its GRPO groups in the rollout inspector.</p>",
        f"<table class='steps'><tr>{head}</tr>{body}</table>",
    ]


def render_html(
    run_dir: Path,
    logs: RunLogs,
    charts: dict[str, Path],
    skipped: dict[str, str],
    findings: list[Finding] = (),  # type: ignore[assignment]
    config: dict | None = None,
) -> str:
    steps = [m for m in training_rows(logs) if not m.get("final")]
    parts = [
        f"<!doctype html><html><head><meta charset='utf-8'><title>relayrl report: "
        f"{html.escape(run_dir.name)}</title><style>{STYLE}</style></head><body>",
        f"<h1>relayrl run report: {html.escape(run_dir.name)}</h1>",
        f"<p>{len(steps)} training steps logged, {len(logs.samples)} trained samples. "
        f"<a href='{PAGE}'>Open the rollout inspector</a> (every GRPO group, tokens coloured "
        "by weight version; re-build it with <code>relayrl inspect RUN_DIR</code>).</p>",
        "<h2>Summary</h2>",
        render_table(summary_rows(logs, config or {}, steps)),
    ]
    parts.extend(render_findings(list(findings)))
    parts.append("<h2>Charts</h2>")
    for name, path in charts.items():
        data = base64.b64encode(path.read_bytes()).decode()
        parts.append(f"<img alt='{name}' title='{name}' src='data:image/png;base64,{data}'>")
    if skipped:
        parts.append("<p>Skipped: " + ", ".join(f"{k} ({v})" for k, v in skipped.items()) + "</p>")
    parts.extend(render_steps(steps))
    parts.extend(render_samples(logs))
    parts.append("</body></html>")
    return "\n".join(parts)


def build_report(run_dir: str | Path) -> Report:
    """Write ``RUN_DIR/report/index.html``, its PNGs and the inspector page next to them."""
    run = Path(run_dir)
    logs = load_run(run)
    config = read_config(run)
    out = run / "report"
    out.mkdir(exist_ok=True)
    charts, skipped = draw_charts(logs, out, config)
    findings = run_findings(logs, config, (run / "train_summary.json").is_file())
    build_inspector(run)
    page = out / "index.html"
    page.write_text(render_html(run, logs, charts, skipped, findings, config))
    return Report(page, charts, skipped)
