"""``task.name=reasoning_gym``: reasoning-gym's generators and its own scorer as a relayrl task.

* problems are reasoning-gym's items (question and answer as the library generates them for
  that index), deterministic, and train and test are disjoint by question;
* the grader is the dataset's own ``score_answer``: chain_sum's decimal comparison
  (``7e0`` is 7) is reasoning-gym's, not relayrl's ``####`` rule; a partial
  score (the default scorer's containment credit) is reward 0, since pass@k counts rewards
  above 0; graded in spawned grading workers (the item is rebuilt there from the meta);
* demonstrations: a worked chain for chain_sum that grades 1, its wrong variant 0;
* bad settings: an unknown dataset or config key is one error naming it.
"""

from __future__ import annotations

import random

import pytest

from relayrl.errors import RelayError
from relayrl.rewards.dispatch import grade_detail
from relayrl.rewards.math import grade_math
from relayrl.rewards.pool import GradingPool
from relayrl.tasks.registry import make_task

reasoning_gym = pytest.importorskip("reasoning_gym")
SMALL = {"dataset": "chain_sum", "config": {"max_terms": 4, "max_digits": 1}}


@pytest.fixture(scope="module")
def task():
    return make_task("reasoning_gym", SMALL)


def test_problems_are_reasoning_gyms_items_with_disjoint_splits(task):
    train = task.problems("train", 400, seed=0)
    test = task.problems("test", 40, seed=0)
    assert train == task.problems("train", 400, seed=0)  # deterministic
    assert not {p.prompt for p in train} & {p.prompt for p in test}
    library = reasoning_gym.create_dataset("chain_sum", seed=0, size=10, max_terms=4, max_digits=1)
    for problem in train[:20]:
        item = library[problem.meta["index"]]  # the library's own item for that index
        assert (problem.prompt, problem.answer) == (item["question"], item["answer"])
        assert problem.grader == "reasoning_gym"


def test_the_grader_is_the_datasets_own_scorer(task):
    problem = next(p for p in task.problems("train", 50, seed=1) if int(p.answer) > 0)
    assert grade_detail(problem, f"#### {problem.answer}")[0] == 1.0
    # chain_sum's scorer compares decimals (Decimal("7e0") == 7); relayrl's own #### rule
    # (the arithmetic task's grader) does not read an exponent
    completion = f"work\n#### {problem.answer}e0"
    reward, info = grade_detail(problem, completion)
    assert reward == 1.0 and info["rg_score"] == 1.0
    assert not grade_math(completion, problem.answer)
    assert grade_detail(problem, f"#### {int(problem.answer) + 1}")[0] == 0.0
    assert grade_detail(problem, "no answer line") == (0.0, {"extracted": None, "rg_score": 0.0})


def test_a_partial_score_is_reward_0():
    """leg_counting uses reasoning-gym's default scorer: an answer that contains the gold
    scores len(gold) / len(answer), here 3/4; relayrl counts it wrong."""
    legs = make_task("reasoning_gym", {"dataset": "leg_counting"})
    problem = next(p for p in legs.problems("train", 50, seed=0) if len(p.answer) == 3)
    reward, info = grade_detail(problem, f"#### 9{problem.answer}")
    assert reward == 0.0 and info["rg_score"] == pytest.approx(0.75)


def test_demonstrations_grade_as_planted(task):
    rng = random.Random(0)
    problems = task.problems("train", 60, seed=2)
    right = [grade_detail(p, task.demonstration(p, rng))[0] for p in problems]
    wrong = [grade_detail(p, task.demonstration(p, rng, wrong=True))[0] for p in problems]
    assert right == [1.0] * 60 and sum(wrong) == 0.0
    problem = next(p for p in problems if p.prompt.count(" + ") + p.prompt.count(" - ") == 2)
    lines = task.demonstration(problem, rng).splitlines()
    assert len(lines) == 3 and lines[-1] == f"#### {problem.answer}"  # two steps, the answer


def test_spawned_grading_workers_rebuild_the_item(task):
    problems = task.problems("test", 8, seed=0)
    items = [(p, f"#### {p.answer}") for p in problems[:4]]
    items += [(p, f"#### {int(p.answer) - 3}") for p in problems[4:]]
    with GradingPool(workers=1, timeout_s=60.0) as pool:
        results = pool.grade_batch(items)
    assert [r.reward for r in results] == [1.0] * 4 + [0.0] * 4


def test_bad_settings_name_the_key():
    with pytest.raises(RelayError, match="unknown reasoning-gym dataset 'chainsum'.*chain_sum"):
        make_task("reasoning_gym", {"dataset": "chainsum"})
    with pytest.raises(RelayError, match="task.params.config.*max_term"):
        make_task("reasoning_gym", {"dataset": "chain_sum", "config": {"max_term": 3}})


def test_answers_in_the_format_reasoning_gym_asks_for(task):
    """reasoning-gym's system prompt asks for ``<answer>…</answer>``; ``####`` stays; the
    last tag wins."""
    problem = task.problems("test", 1, seed=0)[0]
    assert grade_detail(problem, f"thinking\n<answer> {problem.answer} </answer>")[0] == 1.0
    assert grade_detail(problem, f"<answer>999</answer> no, <answer>{problem.answer}</answer>")[0]
    assert grade_detail(problem, f"#### {problem.answer}")[0] == 1.0
    # a sentence answer is not graded by default ...
    assert grade_detail(problem, f"The final answer is {problem.answer}.")[0] == 0.0


def test_extract_last_number_for_a_model_that_answers_in_a_sentence():
    task = make_task("reasoning_gym", {**SMALL, "extract": ["tag", "hash", "last_number"]})
    problem = task.problems("test", 1, seed=0)[0]
    assert grade_detail(problem, f"1 + 2 = 3, so the final answer is {problem.answer}.")[0] == 1.0
    assert grade_detail(problem, f"<answer>{problem.answer}</answer> or 12345")[0] == 1.0
    with pytest.raises(RelayError, match="task.params.extract"):
        make_task("reasoning_gym", {**SMALL, "extract": []})
