"""What the preflight's checks share: the inputs of the run and what earlier checks built.

Owns: :class:`CheckContext`. The checks fill it in order (the config, the task and its
sample problems, the model directory, tokenizer and policy, the grading pool, the server
and its sampled group, the trainer) and :meth:`CheckContext.close` tears down what they
started (server, grading pool, temporary directory), whatever failed.

Imports: config, the standard library.
"""

from __future__ import annotations

import contextlib
import shutil
import tempfile
from collections.abc import Callable
from concurrent.futures import Future
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from relayrl.config.schema import RunConfig

STOP_WAIT_S = 300.0  # how long teardown waits for a server still starting


@dataclass
class CheckContext:
    """The preflight's inputs (``load``: the config as the command reads it, e.g. with
    ``--resume``; ``config_path``: its file, for its ``plugins:``) and its shared state."""

    load: Callable[[list[str]], RunConfig]
    config_path: str | None = None
    plugins: list[str] = field(default_factory=list)
    debug: bool = False
    config: RunConfig | None = None
    task: Any = None
    problems: list[Any] = field(default_factory=list)  # the first and a random row
    problem_count: int = 0
    model_dir: Path | None = None
    tokenizer: Any = None
    model: Any = None
    prompt_ids: list[int] = field(default_factory=list)
    pool: Any = None
    backend: Any = None
    launcher: Any = None
    server_start: Future | None = None  # the server's URLs once it is up
    group: list[Any] = field(default_factory=list)  # the server's sampled trajectories
    generation_s: float = 0.0
    trainer: Any = None
    measures: dict[str, float] = field(default_factory=dict)
    passed: set[str] = field(default_factory=set)  # the checks that passed so far
    settings: contextlib.ExitStack = field(default_factory=contextlib.ExitStack)  # undone by close
    _tmp: Path | None = None

    @property
    def tmp(self) -> Path:
        """A private temporary directory (0700) for what the checks write: never the run
        directory."""
        if self._tmp is None:
            self._tmp = Path(tempfile.mkdtemp(prefix="relayrl-check-"))
        return self._tmp

    def close(self) -> None:
        """Stop the server and the grading pool, remove the temporary directory."""
        if self.server_start is not None:  # a server still starting: stop it once started
            with contextlib.suppress(Exception):
                self.server_start.exception(timeout=STOP_WAIT_S)
        if self.launcher is not None:
            with contextlib.suppress(Exception):
                self.launcher.stop()
        if self.pool is not None:
            with contextlib.suppress(Exception):
                self.pool.close()
        if self._tmp is not None:
            shutil.rmtree(self._tmp, ignore_errors=True)
        self.settings.close()
