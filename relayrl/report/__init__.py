"""Run reports: a self-contained HTML page and PNG charts built from a run directory's
``metrics.jsonl`` and ``samples.jsonl`` (summary table, findings, the mismatch doctor), and
the rollout inspector's page (``inspect.html``) from its ``inspect.jsonl``.

Imports: matplotlib (headless Agg backend), the standard library; nothing from training, so
a report can be built from any run directory, finished or still running.
"""
