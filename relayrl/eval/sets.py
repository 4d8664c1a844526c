"""The held-out sets a run evaluates on (``eval.datasets``) and their per-set metrics.

:func:`eval_problems` builds one list from the config: each set's problems (its own grader:
math for GSM8K/MATH/AIME, the sandboxed code grader for HumanEval, the task's for the
synthetic task) tagged with the set's name in ``meta["eval_set"]`` and interleaved round
robin, so the training loop's periodic evaluation (a prefix of ``train.eval_problems``)
samples every set and the final one (all of them) covers each in full. Without
``eval.datasets`` a run that trains on ``rollout.dataset`` evaluates on that dataset's test
split (GSM8K's for gsm8k_train, MATH-500 for math_train, a hub dataset's or a saved
``DatasetDict``'s ``test`` split, read with the same columns, template and grader); a
dataset with none is an error asking for ``eval.datasets`` (never a silent switch to the
synthetic task). A run without ``rollout.dataset`` evaluates on the task's test split.

:func:`load_source` reads a :class:`~relayrl.config.schema.DataSource` (``rollout.dataset``
or an ``eval.datasets`` entry) with its columns, template and grader.

:func:`set_summaries` splits an evaluation's per-problem results by that tag and
:func:`set_metrics` names them for the metrics row: ``eval_pass@1/<set>``,
``eval_pass@<k>/<set>``, ``eval_maj@<k>/<set>``.

Imports: relayrl.config, relayrl.tasks, relayrl.eval.metrics.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from relayrl.config.schema import DataSource, EvalDataset, RunConfig
from relayrl.errors import RelayError
from relayrl.eval.metrics import mean_maj_at_k, mean_pass_at_k
from relayrl.tasks.base import Problem, SyntheticTask
from relayrl.tasks.datasets import saved_splits

SET_KEY = "eval_set"
TASK = "task"
# train-only datasets -> the held-out set of the same distribution
TEST_SPLIT_OF = {"gsm8k_train": "gsm8k", "math_train": "math500"}


def default_datasets(config: RunConfig) -> list[EvalDataset]:
    """``eval.datasets``, else the test split of ``rollout.dataset``, else none (the task's
    test split, untagged). A ``rollout.dataset`` without a test split is an error."""
    if config.eval.datasets:
        return list(config.eval.datasets)
    source = config.rollout.dataset
    if source is None:
        return []
    if source.data in TEST_SPLIT_OF:
        return [EvalDataset(data=TEST_SPLIT_OF[source.data])]
    if source.data.startswith("hub:") or "test" in (saved_splits(source.data) or ()):
        return [EvalDataset(**source.model_dump())]
    raise RelayError(no_test_split(source, config.task.name))


def no_test_split(source: DataSource, task_name: str) -> str:
    """The error for a ``rollout.dataset`` with no test split and no ``eval.datasets``."""
    splits = saved_splits(source.data)
    has = f" (its splits: {splits})" if splits is not None else ""
    return (
        f"rollout.dataset={source.data} has no test split to evaluate on{has}, and "
        "eval.datasets is empty: name the held-out set, e.g. "
        "eval.datasets='[{data: my_test.jsonl}]' (with the same prompt_field, answer_field, "
        f"template and grader as rollout.dataset), or eval.datasets='[{{data: task}}]' for "
        f"task {task_name!r}'s test split"
    )


def load_source(
    source: DataSource,
    key: str,
    split: str,
    limit: int | None = None,
    data_root: str | Path | None = None,
) -> list[Problem]:
    """The problems of ``source`` (its ``split`` where the data has splits), its columns,
    template and grader applied; errors about its columns name ``key`` (a config key, or
    ``relayrl.tasks.datasets.FLAGS`` for command-line flags). ``data_root``: the folder of
    the known benchmarks' files (default ``$RELAYRL_DATA``)."""
    from relayrl.tasks.datasets import load_problems

    return load_problems(
        source.data,
        data_root=data_root,
        fields=source.field_map(),
        template=source.template,
        grader=source.grader,
        split=split,
        limit=limit,
        key=key,
    )


def set_name(spec: EvalDataset, task_name: str) -> str:
    """The set's label: ``name``, else the task's name, the hub name, the file's stem or
    the saved dataset directory's name."""
    if spec.name:
        return spec.name
    if spec.data == TASK:
        return task_name
    if spec.data.startswith("hub:"):
        return spec.data[4:].replace("/", "_")
    if spec.data.endswith((".jsonl", ".parquet")):
        return Path(spec.data).stem
    return Path(spec.data).name if Path(spec.data).is_dir() else spec.data


def load_set(
    spec: EvalDataset, config: RunConfig, task: SyntheticTask, key: str = "eval.datasets"
) -> list[Problem]:
    """One set's problems, tagged with its name (``key``: the set's config key, for errors)."""
    limit = spec.limit or config.eval.num_problems
    if spec.data == TASK:
        problems = task.problems("test", limit, config.task.seed)
    else:
        problems = load_source(spec, key, "test", limit)
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
        return task.problems("test", config.eval.num_problems, config.task.seed)
    names = [set_name(s, config.task.name) for s in specs]
    if len(set(names)) != len(names):
        raise RelayError(f"eval.datasets: two sets share a name in {names}; give each a name")
    keys = [f"eval.datasets[{i}]" for i in range(len(specs))]
    if not config.eval.datasets:
        keys = ["rollout.dataset"]  # its test split, read as it says
    return interleave([load_set(s, config, task, k) for s, k in zip(specs, keys, strict=True)])


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
