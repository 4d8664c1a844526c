"""The cost of grading reasoning-gym answers in the sandbox (relayrl.rewards.isolated) vs
in-process, on the task of the reasoning-gym demo config (configs/smollm2.yaml: chain_sum).

``python scripts/isolated_grading_cost.py [--config configs/smollm2.yaml] [--n 512]``: grades
N answers (half right, half wrong) both ways in this process, one at a time as a grading
worker does; prints the seconds per answer of each, the sandboxed process's start, and
``isolated_vs_inprocess`` (the ratio, start included, over the N answers).
"""

from __future__ import annotations

import argparse
import random
import time

import yaml

from relayrl.rewards import dispatch, isolated
from relayrl.tasks.registry import make_task


def answers(config: str, n: int) -> list[tuple]:
    with open(config, encoding="utf-8") as f:
        task_cfg = yaml.safe_load(f)["task"]
    task = make_task(task_cfg["name"], task_cfg.get("params", {}))
    rng = random.Random(0)
    problems = task.problems("train", n, seed=0)
    return [(p, task.demonstration(p, rng, wrong=i % 2 == 1)) for i, p in enumerate(problems)]


def timed(grade, items: list[tuple]) -> tuple[float, list[float]]:
    start = time.perf_counter()
    rewards = [grade(p, c)[0] for p, c in items]
    return time.perf_counter() - start, rewards


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--config", default="configs/smollm2.yaml")
    parser.add_argument("--n", type=int, default=512)
    args = parser.parse_args()
    items = answers(args.config, args.n)
    raw = dispatch.GRADERS.lookup(items[0][0].grader)
    raw(*items[0])  # imports and dataset opened: the in-process side at its best
    inproc_s, inproc = timed(raw, items)
    start = time.perf_counter()
    isolated.grade_isolated(items[0][0].grader, *items[0])
    first_s = time.perf_counter() - start
    isolated.close_all()
    iso_s, iso = timed(dispatch.grade_detail, items)
    assert iso == inproc, "the sandboxed grader disagrees with the in-process one"
    n = len(items)
    print(f"answers={n} right={sum(inproc):.0f} batch_items={isolated.BATCH_ITEMS}")
    print(f"inprocess_ms_per_answer={1e3 * inproc_s / n:.3f}")
    print(f"isolated_ms_per_answer={1e3 * iso_s / n:.3f} (process starts included)")
    print(f"isolated_start_s={first_s:.2f}")
    print(f"isolated_vs_inprocess={iso_s / inproc_s:.1f}")


if __name__ == "__main__":
    main()
