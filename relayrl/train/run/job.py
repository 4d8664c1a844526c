"""`relayrl train`: the asynchronous RL job (rollout servers + controller + trainer), or its
lag emulation, composed from one :class:`~relayrl.train.run.setup.RunSetup` and a batch
source.

Owns: :func:`run_train` and :func:`weights_root` (where a live run's published weights
go). A live run (``rollout.lag: async``) starts the backend's rollout
servers and trains on :class:`~relayrl.train.run.live.LiveSource`; lag emulation
(``rollout.lag: fixed | uniform``) starts none and trains on
:class:`~relayrl.train.run.lagged.LaggedSource`. Both grade in a
:class:`~relayrl.rewards.pool.GradingPool`. With ``train.world_size`` N > 1 the trainer is
rank 0 of N data-parallel ranks (``relayrl.train.distributed``), with the same interface.

Imports: config, errors, the launch layer's backends, the rewards pool, relayrl.train.resume
(run start, the orphaned-directory sweep) and the run package (its input checks:
``start``).
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import shutil
import tempfile
from pathlib import Path

from relayrl.config.schema import RunConfig
from relayrl.errors import RelayError
from relayrl.launch.backends import make_backend
from relayrl.launch.launchers import make_launcher
from relayrl.launch.teacher import teacher_launcher, with_teacher_url
from relayrl.rewards.pool import Grader, GradingPool
from relayrl.train.resume import begin_run, remove_orphaned_dirs
from relayrl.train.run.lagged import LaggedSource
from relayrl.train.run.live import LiveSource
from relayrl.train.run.process import process_settings
from relayrl.train.run.setup import (
    RunSetup,
    TrainResult,
    planned_model_dir,
    resolve_model_dir,
    with_progress,
)
from relayrl.train.run.start import check_run_inputs


def weights_root(config: RunConfig, run_dir: Path) -> Path:
    """Where published weights go: ``train.weights_dir``, else tmpfs, else the run dir. When
    the launcher may place the servers on other nodes (:meth:`Launcher.spans_nodes`:
    ``launcher: ray`` with an address, or a plugin launcher's own answer), node-local tmpfs
    is skipped for the run dir (which must be on a shared filesystem)."""
    remote = make_launcher(config).spans_nodes()
    if config.train.weights_dir:
        base = Path(config.train.weights_dir)
    elif not remote and Path("/dev/shm").is_dir() and os.access("/dev/shm", os.W_OK):
        base = Path("/dev/shm")
    else:
        base = run_dir
    base.mkdir(parents=True, exist_ok=True)
    prefix = f"relayrl-{config.name}-weights-"
    remove_orphaned_dirs(base, prefix)  # left by a killed run (tmpfs is memory)
    return Path(tempfile.mkdtemp(prefix=f"{prefix}{os.getpid()}-", dir=base))


def run_train(
    config: RunConfig,
    progress: bool | None = None,
    grader: Grader | None = None,
    resume: bool = False,
    overwrite: bool = True,
) -> TrainResult:
    """The `relayrl train` job; see the module docstring. Returns the final evaluation.

    ``grader(problem, completion) -> reward`` replaces the task's verifier for training
    rewards (a module-level function: it runs in spawned grading processes). ``resume``:
    continue the run in ``<output_dir>/<name>`` from its newest good checkpoint (see
    ``relayrl.train.resume.resume_config`` for loading that run's config).
    ``overwrite=False`` (the CLI without ``--overwrite``): an earlier run under the same
    name is an error. Either way nothing is written into the run directory before every
    input is checked (:func:`relayrl.train.run.start.check_run_inputs`).
    """
    from relayrl.config.loader import claim_run_dir, prepare_run_dir, run_dir_of
    from relayrl.rewards.sandbox import sandbox_settings

    config = with_progress(config, progress)
    lagged = config.rollout.lag != "async"  # lag emulation: no rollout server
    if lagged and resume:
        raise RelayError(
            f"rollout.lag={config.rollout.lag} runs cannot be resumed: the weight snapshots "
            "they generate from are kept in memory only; start the run again"
        )
    check_run_inputs(config)  # model, template, datasets, loggers, ranks: nothing written yet
    claim_run_dir(run_dir_of(config), resume=resume, overwrite=overwrite)
    backend = make_backend(config, planned_model_dir(config))
    launcher = None if lagged else backend.launcher(run_dir_of(config))  # checks its env
    model_dir = resolve_model_dir(config, config.train.progress, reuse_sft=resume)
    run_dir = prepare_run_dir(config)
    checkpoint = begin_run(run_dir, config, resume)
    teacher = teacher_launcher(config, run_dir)  # on-policy distillation's teacher server
    with contextlib.ExitStack() as teardown:  # in reverse: weights, setup, servers, pool
        teardown.enter_context(sandbox_settings(config.sandbox.allow_unisolated))
        if teacher is not None:
            teardown.callback(teacher.stop)
            teacher.start()
            config = with_teacher_url(config, teacher)
        pool = GradingPool(
            config.rollout.reward_workers, config.rollout.reward_timeout_s, grader=grader
        )
        teardown.callback(pool.close)
        if launcher is not None:
            teardown.callback(launcher.stop)
        teardown.enter_context(process_settings(config))
        if launcher is None:
            setup = RunSetup.build(config, run_dir, model_dir)
            teardown.callback(setup.close)
            result = asyncio.run(LaggedSource(setup, pool, backend).train())
        else:
            urls = launcher.start()
            setup = RunSetup.build(config, run_dir, model_dir, append=checkpoint is not None)
            teardown.callback(setup.close)
            weights = weights_root(config, run_dir)
            teardown.callback(shutil.rmtree, weights, ignore_errors=True)

            async def live() -> TrainResult:
                source = await LiveSource.connect(setup, pool, launcher, backend, urls, weights)
                return await source.train(checkpoint)

            result = asyncio.run(live())
    return setup.finish(result)
