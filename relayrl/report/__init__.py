"""Run reports: a self-contained HTML page and PNG charts built from a run directory's
``metrics.jsonl`` and ``samples.jsonl`` (summary table, findings, the mismatch doctor), the
rollout inspector's page (``inspect.html``) from its ``inspect.jsonl``, and reading a run's
logs (``logs``).

Imports: matplotlib (headless Agg backend), yaml, the standard library, relayrl.metric_names
and relayrl.errors; nothing from training (nor relayrl.engine or relayrl.rewards, its
independent siblings), so a report can be built from any run directory, finished or still
running.
"""
