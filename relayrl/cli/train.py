"""``relayrl train CONFIG [KEY=VALUE ...]``: asynchronous RL (servers + controller + trainer).
``relayrl train --resume RUN_DIR [KEY=VALUE ...]`` continues a run from its newest good
checkpoint (its saved config.yaml plus the overrides; docs/reliability.md).

``relayrl train --replay-from RUN_DIR CONFIG [KEY=VALUE ...]`` trains instead on the
trajectories a run recorded with ``train.dump_trajectories=true`` (no rollout server, no
grading). Under ``torchrun --nproc-per-node N`` (with ``train.world_size=N``) rank 0 runs
the job and the other ranks only train (``relayrl.train.distributed``). Prints the run
directory, ``train_seconds= steps= staleness_mean= staleness_max=`` (the realised staleness
of the trained samples over the run), the publication count and latency and, as the last
line,
``final_pass@1=0.xx``.
"""

from __future__ import annotations

import argparse
import signal

from relayrl.cli.common import add_overwrite_argument
from relayrl.errors import RelayError
from relayrl.metric_names import (
    PUBLICATIONS,
    PUBLISH_LATENCY_MEAN_S,
    ROLLOUT_ENGINE,
    STALENESS_MAX,
    STALENESS_MEAN,
)

HELP = "train with asynchronous RL (starts rollout servers); prints final_pass@1"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "config", nargs="?", default=None, help="YAML run config (see configs/); not with --resume"
    )
    parser.add_argument(
        "overrides",
        nargs="*",
        metavar="KEY=VALUE",
        help="dotted overrides, e.g. rollout.eta=2 train.total_steps=100",
    )
    parser.add_argument(
        "--resume",
        metavar="RUN_DIR",
        default=None,
        help="continue the run in RUN_DIR from its newest good checkpoint "
        "(SIGINT/SIGTERM write one before stopping)",
    )
    parser.add_argument(
        "--replay-from",
        metavar="RUN_DIR",
        default=None,
        help="train only, on the trajectories RUN_DIR recorded with train.dump_trajectories="
        "true (no rollout server, no grading)",
    )
    add_overwrite_argument(parser)
    parser.add_argument(
        "--check",
        action="store_true",
        help="run the preflight of `relayrl check` on this config, then exit (no training)",
    )


def interrupt_on_sigterm() -> None:
    """SIGTERM stops the run like Ctrl-C: servers and graders are shut down cleanly (during
    the training loop: after the current step, with a checkpoint)."""

    def handler(signum, frame):  # noqa: ARG001
        raise KeyboardInterrupt

    signal.signal(signal.SIGTERM, handler)


def _config(args: argparse.Namespace, plugins: list[str] | None = None):
    overrides = list(args.overrides)
    if args.resume is None:
        if args.config is None:
            raise RelayError("relayrl train needs a CONFIG (or --resume RUN_DIR)")
        from relayrl.config.loader import load_config

        plugins = plugins if plugins is not None else getattr(args, "plugin", None)
        return load_config(args.config, overrides, plugins=plugins)
    if args.config is not None:
        if "=" not in args.config:
            raise RelayError(
                f"--resume takes the config saved in {args.resume}/config.yaml; "
                f"got {args.config!r} too (pass only KEY=VALUE overrides)"
            )
        overrides.insert(0, args.config)  # argparse took the first override as CONFIG
    from relayrl.train.resume import resume_config

    return resume_config(args.resume, overrides)


def run(args: argparse.Namespace) -> int:
    if args.check:
        from relayrl.cli.check import run_preflight

        return run_preflight(args, lambda plugins: _config(args, plugins))
    if args.resume is not None and args.overwrite:
        raise RelayError("--resume continues a run and --overwrite replaces it: give one")
    config = _config(args)
    from relayrl.train.distributed import run_torchrun_worker

    if run_torchrun_worker(config):  # ranks 1..N-1 under torchrun: train only
        return 0
    interrupt_on_sigterm()
    if args.replay_from:
        from relayrl.train.run import run_replay

        result = run_replay(config, args.replay_from, overwrite=args.overwrite)
    else:
        from relayrl.train.run import run_train

        result = run_train(config, resume=args.resume is not None, overwrite=args.overwrite)
    print(f"run directory: {result.run_dir}")
    print_result_lines(result)
    return 0


def result_lines(result) -> list[str]:
    """The closing lines of `relayrl train` / `relayrl demo`: time, steps and the realised
    staleness of the trained samples (mean and max over the run, from its metrics), then
    ``final_pass@1=0.xx`` last."""
    line = f"train_seconds={result.seconds:.1f} steps={result.steps}"
    if STALENESS_MEAN in result.summary:
        line += (
            f" staleness_mean={result.summary[STALENESS_MEAN]:.2f}"
            f" staleness_max={result.summary[STALENESS_MAX]:.0f}"
        )
    lines = [line]
    if result.summary.get(PUBLICATIONS):
        lines.append(
            f"publications={result.summary[PUBLICATIONS]} "
            f"publish_latency_mean_s={result.summary[PUBLISH_LATENCY_MEAN_S]:.3f} "
            f"(rollout.engine={result.summary[ROLLOUT_ENGINE]})"
        )
    if result.final_pass_at_1 is not None:
        lines.append(f"final_pass@1={result.final_pass_at_1:.2f}")
    return lines


def print_result_lines(result) -> None:
    for line in result_lines(result):
        print(line)
