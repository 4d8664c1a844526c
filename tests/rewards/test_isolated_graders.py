"""Graders that read model-written text run in the sandbox (relayrl.rewards.isolated).

reasoning-gym's ``score_answer`` evaluates answers on several datasets (``eval(answer)`` in
string_insertion, spiral_matrix, binary_matrix, n_queens). Graded through a real grading
pool, as a run grades:

* an answer that runs a shell command or writes a host file scores 0 and leaves nothing;
* an answer that patches the dataset's scorer scores 0, and so does the wrong answer after
  it (before: every later answer of that worker scored 1.0);
* a correct answer still scores 1;
* a plugin's grader is sandboxed unless it declares itself safe;
* a sandbox that cannot run the grader stops the batch with an error, never a 0;
* a grader whose set-up (``warm``) fails in the sandbox stops the batch too (before: every
  item scored 0 as ``scorer_died``: reasoning-gym installed on ``PYTHONPATH`` trained a
  whole run on zero rewards);
* packages this interpreter imports from ``PYTHONPATH`` are importable in the sandbox.
"""

from __future__ import annotations

import json
import os
import textwrap

import pytest

from relayrl import plugins
from relayrl.errors import RelayError
from relayrl.rewards.pool import GradingPool
from relayrl.tasks.base import Problem
from relayrl.tasks.registry import make_task

pytest.importorskip("reasoning_gym")
EVAL_DATASETS = ("string_insertion", "spiral_matrix", "binary_matrix", "n_queens")
MODULES = {
    "string_insertion": "reasoning_gym.algorithmic.string_insertion:StringInsertionDataset",
    "spiral_matrix": "reasoning_gym.algorithmic.spiral_matrix:SpiralMatrixDataset",
    "binary_matrix": "reasoning_gym.algorithmic.binary_matrix:BinaryMatrixDataset",
    "n_queens": "reasoning_gym.games.n_queens:NQueensDataset",
}


def _answer(text: str) -> str:
    return f"<answer>{text}</answer>"


def _payloads(marker) -> list[str]:
    """Answers that, evaluated, write ``marker`` on the host (shell, then Python)."""
    return [
        _answer(f"__import__('os').system('id > {marker}')"),
        _answer(f"open({str(marker)!r}, 'w').write('pwned')"),
        f"#### __import__('os').system('id > {marker}')",
    ]


def _patch(dataset: str) -> str:
    """An answer that, evaluated, makes the dataset's scorer give 1.0 to everything."""
    module, cls = MODULES[dataset].split(":")
    return _answer(
        f"setattr(getattr(__import__({module!r}, fromlist=['x']), {cls!r}), 'score_answer', "
        "lambda self, answer, entry: 1.0)"
    )


@pytest.fixture(scope="module")
def pool():
    with GradingPool(workers=1, timeout_s=120) as pool:
        yield pool


@pytest.mark.parametrize("dataset", EVAL_DATASETS)
def test_an_eval_payload_scores_0_and_leaves_nothing(dataset, pool, tmp_path):
    problem = make_task("reasoning_gym", {"dataset": dataset}).problems("test", 1, seed=0)[0]
    marker = tmp_path / "pwned"
    items = [(problem, text) for text in _payloads(marker)]
    items.append((problem, _answer(problem.answer)))
    results = pool.grade_batch(items)
    assert [r.reward for r in results] == [0.0, 0.0, 0.0, 1.0], results
    assert all(r.status == "ok" for r in results), results
    assert not marker.exists() and list(tmp_path.iterdir()) == []


@pytest.mark.parametrize("dataset", EVAL_DATASETS)
def test_a_patched_scorer_never_grades_another_answer(dataset, pool):
    task = make_task("reasoning_gym", {"dataset": dataset})
    problem, other = task.problems("test", 2, seed=0)
    wrong = _answer(other.answer if other.answer != problem.answer else problem.answer + "x")
    items = [(problem, _patch(dataset)), (problem, wrong), (problem, wrong)]
    items.append((problem, _answer(problem.answer)))
    results = pool.grade_batch(items)
    assert [r.reward for r in results] == [0.0, 0.0, 0.0, 1.0], results


@pytest.fixture
def plugin_env():
    saved = os.environ.pop(plugins.ENV, None)
    yield
    os.environ.pop(plugins.ENV, None)
    if saved is not None:
        os.environ[plugins.ENV] = saved


PLUGIN = textwrap.dedent(
    """\
    import os
    from relayrl.rewards.dispatch import register_grader

    @register_grader("i43_evaluates")
    def evaluates(problem, completion):
        return float(eval(completion) == problem.answer), {"pid": os.getpid()}

    @register_grader("i43_safe", safe=True)
    def safe(problem, completion):
        return float(completion == problem.answer), {"pid": os.getpid()}
    """
)


def test_a_plugin_grader_runs_sandboxed_unless_declared_safe(tmp_path, plugin_env):
    (tmp_path / "i43_grader_plugin.py").write_text(PLUGIN)
    os.environ[plugins.ENV] = json.dumps([str(tmp_path / "i43_grader_plugin.py")])
    os.environ["I43_SECRET"] = "s3cret"
    marker = tmp_path / "pwned"
    problem = Problem("p", "q", "s3cret", grader="i43_evaluates")
    items = [
        (problem, "__import__('os').environ.get('I43_SECRET')"),  # scrubbed environment
        (problem, f"open({str(marker)!r}, 'w').write('x') and 's3cret'"),  # no host writes
        (problem, "'s3' + 'cret'"),  # the right value still scores 1
        (Problem("q", "q", "ok", grader="i43_safe"), "ok"),
    ]
    try:
        with GradingPool(workers=1, timeout_s=120) as pool:
            results = pool.grade_batch(items)
    finally:
        del os.environ["I43_SECRET"]
    assert [r.reward for r in results] == [0.0, 0.0, 1.0, 1.0], results
    assert results[1].status == "error"  # the write failed (the sandbox or its audit hook)
    assert not marker.exists()
    sandboxed, in_worker = results[2].info["pid"], results[3].info["pid"]
    assert sandboxed != in_worker  # the unsafe one ran in another (sandboxed) process


def test_a_sandbox_that_cannot_run_the_grader_stops_the_batch(monkeypatch):
    monkeypatch.setenv("RELAYRL_SANDBOX", "no-such-backend")
    problem = make_task("reasoning_gym", {"dataset": "chain_sum"}).problems("test", 1, seed=0)[0]
    with GradingPool(workers=1, timeout_s=120) as pool:
        with pytest.raises(RelayError, match="sandbox"):
            pool.grade_batch([(problem, _answer(problem.answer))])


def test_an_answer_that_kills_its_grading_process_scores_0_and_the_next_is_graded(pool):
    problem = make_task("reasoning_gym", {"dataset": "spiral_matrix"}).problems("test", 1, seed=0)[
        0
    ]
    kill = "__import__('ctypes').CDLL(None).kill(__import__('os').getppid(), 9)"
    results = pool.grade_batch([(problem, _answer(kill)), (problem, _answer(problem.answer))])
    assert [r.reward for r in results] == [0.0, 1.0], results
    assert results[0].info["status"] == "scorer_died", results


def test_both_sandbox_backends_hold_the_eval_payload(backend, tmp_path):
    problem = make_task("reasoning_gym", {"dataset": "n_queens"}).problems("test", 1, seed=0)[0]
    marker = tmp_path / "pwned"
    with GradingPool(workers=1, timeout_s=120) as pool:
        results = pool.grade_batch(
            [(problem, _payloads(marker)[0]), (problem, _answer(problem.answer))]
        )
    assert [r.reward for r in results] == [0.0, 1.0], results
    assert not marker.exists()


SETUP_PLUGIN = textwrap.dedent(
    """\
    from relayrl.rewards.dispatch import register_grader

    @register_grader("i48_needs_dep")
    def needs_dep(problem, completion):
        import i48_dep
        return float(completion == i48_dep.VALUE), {}

    def _warm(problem):
        import i48_dep  # noqa: F401

    needs_dep.warm = _warm
    """
)


def _setup_plugin(tmp_path) -> Problem:
    (tmp_path / "i48_setup_plugin.py").write_text(SETUP_PLUGIN)
    os.environ[plugins.ENV] = json.dumps([str(tmp_path / "i48_setup_plugin.py")])
    return Problem("p", "q", "a", grader="i48_needs_dep")


def test_a_grader_that_cannot_set_up_in_the_sandbox_stops_the_batch(tmp_path, plugin_env):
    problem = _setup_plugin(tmp_path)  # i48_dep is nowhere: its warm-up raises
    with GradingPool(workers=1, timeout_s=120) as pool:
        with pytest.raises(RelayError, match="could not set up problem 'p'.*i48_dep"):
            pool.grade_batch([(problem, "forty-two")])


def test_packages_on_pythonpath_are_importable_in_the_sandbox(tmp_path, plugin_env, monkeypatch):
    deps = tmp_path / "deps"  # as `pip install --target deps` and PYTHONPATH=deps leave it
    deps.mkdir()
    (deps / "i48_dep.py").write_text("VALUE = 'forty-two'\n")
    monkeypatch.syspath_prepend(str(deps))
    problem = _setup_plugin(tmp_path)
    with GradingPool(workers=1, timeout_s=120) as pool:
        results = pool.grade_batch([(problem, "forty-two"), (problem, "seven")])
    assert [(r.reward, r.status) for r in results] == [(1.0, "ok"), (0.0, "ok")], results
