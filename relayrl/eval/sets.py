"""The held-out sets a run evaluates on (``eval.datasets``) and their per-set metrics.

:func:`eval_problems` builds one list from the config: each set's problems (its own grader:
math for GSM8K/MATH/AIME, the sandboxed code grader for HumanEval, the task's for the
synthetic task) tagged with the set's name in ``meta["eval_set"]`` and interleaved round
robin, so the training loop's periodic evaluation (a prefix of ``train.eval_problems``)
samples every set and the final one (all of them) covers each in full. Without
``eval.datasets`` a run that trains on ``rollout.dataset`` evaluates on that dataset's test
split when it has one; otherwise on the task's test split, as before.

:func:`set_summaries` splits an evaluation's per-problem results by that tag and
:func:`set_metrics` names them for the metrics row: ``eval_pass@1/<set>``,
``eval_pass@<k>/<set>``, ``eval_maj@<k>/<set>``.

Imports: relayrl.config, relayrl.tasks, relayrl.eval.metrics.
"""

from __future__ import annotations

import dataclasses
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from relayrl.config.schema import EvalDataset, RunConfig
from relayrl.errors import RelayError
from relayrl.eval.metrics import mean_maj_at_k, mean_pass_at_k
from relayrl.tasks.base import Problem, SyntheticTask

SET_KEY = "eval_set"
TASK = "task"
# train-only datasets -> the held-out set of the same distribution
TEST_SPLIT_OF = {"gsm8k_train": "gsm8k", "math_train": "math500"}


def default_datasets(config: RunConfig) -> list[EvalDataset]:
    """``eval.datasets``, else the test split of ``rollout.dataset`` (known train sets and
    hub datasets), else none (the task's test split, untagged)."""
    if config.eval.datasets:
        return list(config.eval.datasets)
    source = config.rollout.dataset
    if source in TEST_SPLIT_OF:
        return [EvalDataset(data=TEST_SPLIT_OF[source])]
    if source and source.startswith("hub:"):
        return [EvalDataset(data=source)]
    return []


def set_name(spec: EvalDataset, task_name: str) -> str:
    """The set's label: ``name``, else the task's name, the hub name or the file's stem."""
    if spec.name:
        return spec.name
    if spec.data == TASK:
        return task_name
    if spec.data.startswith("hub:"):
        return spec.data[4:].replace("/", "_")
    return Path(spec.data).stem if spec.data.endswith((".jsonl", ".parquet")) else spec.data


def load_set(spec: EvalDataset, config: RunConfig, task: SyntheticTask) -> list[Problem]:
    """One set's problems, tagged with its name."""
    from relayrl.tasks.datasets import load_problems

    limit = spec.limit or config.eval.num_problems
    if spec.data == TASK:
        problems = task.problems("test", limit, config.task.seed)
    else:
        problems = load_problems(spec.data, grader=spec.grader, split="test", limit=limit)
    if not problems:
        raise RelayError(f"eval.datasets: {spec.data!r} has no problems")
    name = set_name(spec, config.task.name)
    return [dataclasses.replace(p, meta={**p.meta, SET_KEY: name}) for p in problems]


def interleave(sets: Sequence[list[Problem]]) -> list[Problem]:
    """Round robin over the sets: any prefix holds each set in proportion."""
    out: list[Problem] = []
    for i in range(max((len(s) for s in sets), default=0)):
        out.extend(s[i] for s in sets if i < len(s))
    return out


def eval_problems(config: RunConfig, task: SyntheticTask) -> list[Problem]:
    """The run's held-out problems (module docstring)."""
    specs = default_datasets(config)
    if not specs:
        if config.rollout.dataset:
            print(
                f"warning: rollout.dataset={config.rollout.dataset} has no test split relayrl "
                f"knows; held-out evaluation uses task {config.task.name!r}'s test split (name "
                "yours in eval.datasets, e.g. eval.datasets='[{data: my_test.jsonl}]')",
                file=sys.stderr,
                flush=True,
            )
        return task.problems("test", config.eval.num_problems, config.task.seed)
    names = [set_name(s, config.task.name) for s in specs]
    if len(set(names)) != len(names):
        raise RelayError(f"eval.datasets: two sets share a name in {names}; give each a name")
    return interleave([load_set(spec, config, task) for spec in specs])


def set_summaries(
    problems: Sequence[Problem],
    correct: Sequence[Sequence[bool]],
    answers: Sequence[list],
    ks: Sequence[int],
) -> dict[str, dict[str, float]]:
    """Per tagged set: its problem count, pass@1, and pass@k and maj@k for each of ``ks``."""
    groups: dict[str, list[int]] = {}
    for i, problem in enumerate(problems):
        name = problem.meta.get(SET_KEY) if isinstance(problem.meta, dict) else None
        if name is not None:
            groups.setdefault(str(name), []).append(i)
    out: dict[str, dict[str, float]] = {}
    for name, idx in groups.items():
        mine_c, mine_a = [correct[i] for i in idx], [answers[i] for i in idx]
        summary = {"pass@1": mean_pass_at_k(mine_c, 1), "problems": float(len(idx))}
        summary.update({f"pass@{k}": mean_pass_at_k(mine_c, k) for k in ks})
        summary.update({f"maj@{k}": mean_maj_at_k(mine_a, mine_c, k) for k in ks})
        out[name] = summary
    return out


def set_metrics(per_set: dict[str, dict[str, float]]) -> dict[str, Any]:
    """The metrics-row columns of :func:`set_summaries`: ``eval_<metric>/<set>``."""
    return {
        f"eval_{metric}/{name}": value
        for name, summary in per_set.items()
        for metric, value in summary.items()
    }
