"""Shared fixtures. Tests run on 2 shared cores: one torch thread per process."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

torch.set_num_threads(1)

FIXTURE_DATA = Path(__file__).resolve().parent / "fixtures" / "data"


@pytest.fixture(autouse=True)
def _registrations_stay_in_their_test():
    """Names a test (or a user module it imports) registers are dropped after it, so a
    later test can register the same name from its own module (docs' examples share
    names). Module-scoped fixtures' registrations are made before this snapshot: they last
    for their module."""
    from relayrl.algo.advantages import ADVANTAGES
    from relayrl.algo.losses import LOSSES
    from relayrl.registry import ROLLOUT_BACKENDS, WEIGHT_TRANSPORTS
    from relayrl.rewards.dispatch import GRADERS
    from relayrl.rollout.environment import ENVIRONMENTS
    from relayrl.rollout.workflow import WORKFLOWS
    from relayrl.tasks.registry import TASKS

    registries = (ADVANTAGES, LOSSES, ROLLOUT_BACKENDS, WEIGHT_TRANSPORTS, GRADERS)
    registries += (ENVIRONMENTS, WORKFLOWS, TASKS)
    before = [set(r) for r in registries]
    yield
    for registry, names in zip(registries, before, strict=True):
        for name in set(registry) - names:
            del registry[name]


@pytest.fixture(autouse=True)
def _isolated_graders_end_with_their_test():
    """A grader scored in this process (``grade_detail`` of a grader not registered safe)
    keeps a sandboxed grading process; it ends with the test, so that no sandbox process of
    one test is seen by the next (tests that check nothing is left running)."""
    import sys

    yield
    isolated = sys.modules.get("relayrl.rewards.isolated")
    if isolated is not None:
        isolated.close_all()


def benchmark_root() -> Path:
    """Where the benchmark files are: ``$RELAYRL_DATA``, else the full sets beside the checkout
    when present (relayrl's own default lookup), else the samples committed under
    tests/fixtures/data (README.md there: sources and licences)."""
    from relayrl.tasks.datasets import default_data_root

    root = default_data_root()
    return root if root.is_dir() else FIXTURE_DATA


def rows_in(root: Path, relative: str) -> int:
    """The number of rows of a JSONL file under ``root`` (what a loader must return)."""
    with (root / relative).open() as f:
        return sum(1 for line in f if line.strip())


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory) -> Path:
    """A randomly initialised 'tiny' Qwen3 model + task tokenizer saved as an HF directory."""
    from relayrl.models.build import create_model_dir
    from relayrl.tasks.registry import make_task

    out = tmp_path_factory.mktemp("tiny_model")
    create_model_dir(out, make_task("arithmetic"), "tiny", seed=0, corpus_size=500)
    return out


@pytest.fixture(scope="session")
def benchmark_data() -> Path:
    """The folder of benchmark files the tests read (:func:`benchmark_root`)."""
    return benchmark_root()


# `make test` shares the suite between two pytest-xdist workers (tests/_xdist.py says how)
@pytest.hookimpl(optionalhook=True)
def pytest_xdist_make_scheduler(config: pytest.Config, log):
    from tests._xdist import SharedResourceScheduling

    return SharedResourceScheduling(config, log)


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    if hasattr(config, "workerinput"):  # an xdist worker: the long units go first
        from tests._xdist import long_first

        items[:] = long_first(items)
