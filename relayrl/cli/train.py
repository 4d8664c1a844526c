"""``relayrl train CONFIG [KEY=VALUE ...]``: asynchronous RL (servers + controller + trainer).

``relayrl train --replay-from RUN_DIR CONFIG [KEY=VALUE ...]`` trains instead on the
trajectories a run recorded with ``train.dump_trajectories=true`` (no rollout server, no
grading). Prints the run directory, the held-out pass@1 and, as the last line,
``final_pass@1=0.xx``.
"""

from __future__ import annotations

import argparse
import signal

from relayrl.cli.common import add_config_arguments, load_run_config

HELP = "train with asynchronous RL (starts rollout servers); prints final_pass@1"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    add_config_arguments(parser)
    parser.add_argument(
        "--replay-from",
        metavar="RUN_DIR",
        default=None,
        help="train only, on the trajectories RUN_DIR recorded with train.dump_trajectories="
        "true (no rollout server, no grading; put this option before CONFIG)",
    )


def interrupt_on_sigterm() -> None:
    """SIGTERM stops the run like Ctrl-C: servers and graders are shut down cleanly."""

    def handler(signum, frame):  # noqa: ARG001
        raise KeyboardInterrupt

    signal.signal(signal.SIGTERM, handler)


def run(args: argparse.Namespace) -> int:
    config = load_run_config(args)
    interrupt_on_sigterm()
    if args.replay_from:
        from relayrl.train.replay_dump import run_replay

        result = run_replay(config, args.replay_from)
    else:
        from relayrl.train.rl import run_train

        result = run_train(config)
    print(f"run directory: {result.run_dir}")
    print(f"train_seconds={result.seconds:.1f} steps={result.steps}")
    if result.final_pass_at_1 is not None:
        print(f"final_pass@1={result.final_pass_at_1:.2f}")
    return 0
