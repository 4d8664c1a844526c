"""Checkpoint and resume of a `relayrl train` run, and stopping it cleanly.

A run killed at any moment continues from its last checkpoint with no prompt skipped and none
trained twice (docs/reliability.md). One module per concern:

- ``checkpoints``: what a checkpoint holds (:class:`RunCheckpoints`, a registry of named
  stateful components), when it is written, how it is restored;
- ``trainer_state``: the trainer's part (weights, optimizer, scheduler, version, D-ARL) at
  any world size;
- ``rng``: the process's random generators (:class:`RngState`);
- ``run_start``: fresh start or resume (:func:`begin_run`), log truncation,
  :func:`resume_config`;
- ``orphans``: weight directories left by killed runs (:func:`remove_orphaned_dirs`);
- ``signals``: SIGINT/SIGTERM → checkpoint and stop (:class:`StopSignal`).

The names below are this package's API (the training loop and the CLI import them from here).
"""

from relayrl.train.resume.checkpoints import RunCheckpoints, Stateful
from relayrl.train.resume.orphans import remove_orphaned_dirs
from relayrl.train.resume.rng import RngState
from relayrl.train.resume.run_start import SUMMARY, begin_run, resume_config, truncate_logs
from relayrl.train.resume.signals import StopRequested, StopSignal
from relayrl.train.resume.trainer_state import load_trainer_state, restore_trainer, trainer_state

__all__ = [
    "SUMMARY",
    "RngState",
    "RunCheckpoints",
    "Stateful",
    "StopRequested",
    "StopSignal",
    "begin_run",
    "load_trainer_state",
    "remove_orphaned_dirs",
    "resume_config",
    "restore_trainer",
    "trainer_state",
    "truncate_logs",
]
