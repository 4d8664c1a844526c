"""The preflight of a run (``relayrl check``, ``relayrl train --check``): everything that
can fail, checked in seconds, without training.

One module per kind of check: ``inputs`` (plugins, config, dataset, grader, model, chat
template), ``environment`` (backend environment, sandbox, run directory, run key and
ports), ``live`` (one real server and generation with the engine-vs-trainer KL, one timed
optimizer step, the memory estimate); ``runner`` runs them in order, each with a deadline,
and prints one line each; ``context`` is what they share. :func:`preflight` is the API.

Imports: the modules of this package (and through them config, launch, rewards, tasks,
models, engine and the trainer).
"""

from __future__ import annotations

import sys
from collections.abc import Callable
from typing import TextIO

from relayrl.config.schema import RunConfig
from relayrl.train.preflight.context import CheckContext
from relayrl.train.preflight.environment import check_environment, check_run_dir, check_sandbox
from relayrl.train.preflight.inputs import (
    check_config,
    check_dataset,
    check_grader,
    check_model,
    check_plugins,
    check_template,
)
from relayrl.train.preflight.live import check_memory, check_server, check_step, start_server
from relayrl.train.preflight.runner import Check, CheckFailed, Report, run_checks

__all__ = ["CHECKS", "Check", "CheckFailed", "Report", "preflight"]


SERVER_NEEDS = ("environment", "run_dir", "grader")


def template_then_server(ctx: CheckContext) -> str:
    """:func:`check_template`, then (when the checks of :data:`SERVER_NEEDS` passed) one
    server starts booting in the background while the next checks run."""
    detail = check_template(ctx)
    if all(name in ctx.passed for name in SERVER_NEEDS):
        start_server(ctx)
    return detail


CHECKS: tuple[Check, ...] = (
    Check("plugins", check_plugins, fix="fix the module or drop it from --plugin / plugins:"),
    Check(
        "config",
        check_config,
        ("plugins",),
        fix="correct the key or value (`relayrl config --reference` lists every key)",
    ),
    Check("environment", check_environment, ("config",), deadline_s=180.0),
    Check("run_dir", check_run_dir, ("config",)),
    Check("dataset", check_dataset, ("config",), fix="fix the row or rollout.dataset"),
    Check("sandbox", check_sandbox, ("dataset",), deadline_s=120.0),
    Check(
        "grader",
        check_grader,
        ("dataset",),
        deadline_s=120.0,
        fix="check the grader and the rows' answers",
    ),
    Check("model", check_model, ("config",), deadline_s=300.0),
    Check(
        "template",
        template_then_server,
        ("model", "dataset"),
        fix="unset model.system_prompt or fix the template",
    ),
    Check("server", check_server, ("template", *SERVER_NEEDS), deadline_s=600.0),
    Check("step", check_step, ("server",), deadline_s=300.0),
    Check("memory", check_memory, ("step",)),
)


def preflight(
    load: Callable[[list[str]], RunConfig],
    config_path: str | None,
    plugins: list[str],
    debug: bool = False,
    out: TextIO | None = None,
) -> Report:
    """Run :data:`CHECKS` on the config ``load(plugins)`` returns; print one line per check
    to ``out`` (stdout) and tear down what the checks started."""
    ctx = CheckContext(load, config_path, list(plugins), debug)
    try:
        return run_checks(CHECKS, ctx, out or sys.stdout)
    finally:
        ctx.close()
