"""Build ``<run>/report/index.html`` and one PNG per chart from a run directory.

Every chart is optional: a chart whose metrics a run did not log (an SFT-only run, a run
without replay, an older version) is listed as skipped instead of failing the report.
"""

from __future__ import annotations

import base64
import html
import json
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

from relayrl.errors import RelayError

TIME_SPLIT = [
    ("time_wait_s", "waiting for data"),
    ("time_prox_s", "proximal pass"),
    ("time_update_s", "update"),
    ("time_sync_s", "weight sync"),
]


@dataclass
class RunLogs:
    metrics: list[dict]
    samples: list[dict]

    def series(self, key: str, x: str = "step") -> tuple[list[float], list[float]]:
        rows = [m for m in self.metrics if key in m and x in m and m[key] is not None]
        return [r[x] for r in rows], [r[key] for r in rows]

    def has(self, key: str) -> bool:
        return any(key in m and m[key] is not None for m in self.metrics)


@dataclass
class Report:
    html_path: Path
    charts: dict[str, Path] = field(default_factory=dict)
    skipped: dict[str, str] = field(default_factory=dict)


def read_jsonl(path: Path) -> list[dict]:
    """Rows of a JSONL file; a torn last line (a run killed mid-write) is ignored."""
    if not path.is_file():
        return []
    rows = []
    lines = path.read_text().splitlines()
    for number, line in enumerate(lines, 1):
        if not line.strip():
            continue
        try:
            rows.append(json.loads(line))
        except json.JSONDecodeError as exc:
            if number == len(lines):
                break
            raise RelayError(f"{path}:{number}: not valid JSON ({exc.msg})") from exc
    return rows


def load_run(run_dir: Path) -> RunLogs:
    if not run_dir.is_dir():
        raise RelayError(f"run directory {str(run_dir)!r} does not exist")
    logs = RunLogs(read_jsonl(run_dir / "metrics.jsonl"), read_jsonl(run_dir / "samples.jsonl"))
    if not logs.metrics and not logs.samples:
        raise RelayError(f"{run_dir} has neither metrics.jsonl nor samples.jsonl to report on")
    return logs


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


def chart_reward(ax, logs: RunLogs) -> bool:
    ax.set(title="reward and held-out pass@1 by step", xlabel="step")
    return _lines(
        ax, logs, [("reward_mean", "train reward"), ("eval_pass@1", "held-out pass@1")], "step"
    )


def chart_reward_time(ax, logs: RunLogs) -> bool:
    ax.set(title="reward and held-out pass@1 by wall-clock", xlabel="seconds")
    return _lines(
        ax, logs, [("reward_mean", "train reward"), ("eval_pass@1", "held-out pass@1")], "elapsed_s"
    )


def chart_lengths(ax, logs: RunLogs) -> bool:
    by_step: dict[int, list[int]] = {}
    for s in logs.samples:
        if "completion_tokens" in s and "step" in s:
            by_step.setdefault(s["step"], []).append(s["completion_tokens"])
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


def chart_importance(ax, logs: RunLogs) -> bool:
    ax.set(title="importance weights π_prox/μ", xlabel="step")
    return _lines(
        ax,
        logs,
        [
            ("is_weight_mean", "mean"),
            ("is_weight_max", "max"),
            ("clip_frac", "fraction clipped"),
            ("is_masked_frac", "fraction masked"),
            ("is_truncated_frac", "fraction truncated"),
        ],
        "step",
    )


def chart_ess(ax, logs: RunLogs) -> bool:
    keys = [("ess_frac", "ESS / N")]
    keys += sorted(
        {(k, k) for m in logs.metrics for k in m if k.startswith(("replay_kept_frac", "alpha_"))}
    )
    ax.set(title="effective sample size and replay weights", xlabel="step")
    return _lines(ax, logs, keys, "step")


def chart_time_split(ax, logs: RunLogs) -> bool:
    present = [(k, label) for k, label in TIME_SPLIT if logs.has(k)]
    if not present:
        return False
    steps = [m["step"] for m in logs.metrics if "step" in m]
    bottom = [0.0] * len(steps)
    for key, label in present:
        values = [float(m.get(key) or 0.0) for m in logs.metrics if "step" in m]
        ax.bar(steps, values, bottom=bottom, label=label)
        bottom = [b + v for b, v in zip(bottom, values, strict=True)]
    ax.set(title="time per step", xlabel="step", ylabel="seconds")
    ax.legend(loc="best", fontsize=8)
    return True


def chart_throughput(ax, logs: RunLogs) -> bool:
    ax.set(title="throughput", xlabel="step", ylabel="tokens / s")
    return _lines(
        ax, logs, [("gen_tokens_per_s", "generation"), ("train_tokens_per_s", "training")], "step"
    )


CHARTS: dict[str, Callable] = {
    "reward_by_step": chart_reward,
    "reward_by_time": chart_reward_time,
    "response_length": chart_lengths,
    "staleness": chart_staleness,
    "importance_weights": chart_importance,
    "ess": chart_ess,
    "time_split": chart_time_split,
    "throughput": chart_throughput,
}


def draw_charts(logs: RunLogs, out_dir: Path) -> tuple[dict[str, Path], dict[str, str]]:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    charts, skipped = {}, {}
    for name, draw in CHARTS.items():
        fig, ax = plt.subplots(figsize=(6.4, 3.6), dpi=100)
        try:
            if draw(ax, logs):
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
def extreme_samples(logs: RunLogs, steps: int = 3, per_step: int = 2) -> list[tuple[int, list]]:
    """The best and worst trajectories (by reward, then advantage) at a few spread steps."""
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
        rows = sorted(by_step[step], key=lambda s: (s.get("reward", 0), s.get("advantage", 0)))
        out.append((step, rows[-per_step:][::-1] + rows[:per_step]))
    return out


def _sample_row(s: dict) -> str:
    text = s.get("completion_text") or s.get("text") or "(text not recorded: see config)"
    prompt = s.get("prompt_text", "")
    return (
        f"<tr><td>{s.get('reward')}</td><td>{s.get('prompt_id', '')}</td>"
        f"<td>{s.get('version_min', '')}–{s.get('version_max', '')}</td>"
        f"<td>{s.get('finish_reason', '')}</td>"
        f"<td><pre>{html.escape(prompt)}</pre><pre>{html.escape(text)}</pre></td></tr>"
    )


def render_html(
    run_dir: Path, logs: RunLogs, charts: dict[str, Path], skipped: dict[str, str]
) -> str:
    parts = [
        f"<!doctype html><html><head><meta charset='utf-8'><title>relayrl report: "
        f"{html.escape(run_dir.name)}</title><style>body{{font-family:sans-serif;"
        f"max-width:1400px;margin:auto}} img{{max-width:48%;margin:4px}} "
        f"pre{{white-space:pre-wrap;margin:0}} td{{vertical-align:top;border-top:1px solid "
        f"#ddd;padding:4px}}</style></head><body>",
        f"<h1>relayrl run report: {html.escape(run_dir.name)}</h1>",
        f"<p>{len(logs.metrics)} steps logged, {len(logs.samples)} trained samples.</p>",
    ]
    last = logs.metrics[-1] if logs.metrics else {}
    summary = {
        k: last[k]
        for k in ("step", "version", "reward_mean", "eval_pass@1", "staleness_max", "elapsed_s")
        if k in last
    }
    if summary:
        parts.append(
            "<h2>Last step</h2><pre>" + html.escape(json.dumps(summary, indent=1)) + "</pre>"
        )
    parts.append("<h2>Charts</h2>")
    for name, path in charts.items():
        data = base64.b64encode(path.read_bytes()).decode()
        parts.append(f"<img alt='{name}' title='{name}' src='data:image/png;base64,{data}'>")
    if skipped:
        parts.append("<p>Skipped: " + ", ".join(f"{k} ({v})" for k, v in skipped.items()) + "</p>")
    parts.append("<h2>Best and worst sampled trajectories</h2>")
    for step, rows in extreme_samples(logs):
        parts.append(
            f"<h3>step {step}</h3><table><tr><th>reward</th><th>prompt</th>"
            f"<th>versions</th><th>finish</th><th>text</th></tr>"
        )
        parts.extend(_sample_row(s) for s in rows)
        parts.append("</table>")
    parts.append("</body></html>")
    return "\n".join(parts)


def build_report(run_dir: str | Path) -> Report:
    run = Path(run_dir)
    logs = load_run(run)
    out = run / "report"
    out.mkdir(exist_ok=True)
    charts, skipped = draw_charts(logs, out)
    page = out / "index.html"
    page.write_text(render_html(run, logs, charts, skipped))
    return Report(page, charts, skipped)
