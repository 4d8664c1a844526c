import random

import pytest

from relayrl.errors import RelayError
from relayrl.rewards.countdown import evaluate_expression, verify_countdown
from relayrl.rewards.dispatch import score
from relayrl.rewards.math import grade_math
from relayrl.tasks.registry import make_task

TASKS = ["arithmetic", "countdown"]


@pytest.mark.parametrize("name", TASKS)
def test_generation_is_deterministic_by_seed(name):
    task = make_task(name)
    a = task.problems("train", 200, seed=5)
    b = list(make_task(name)._generate("train", 200, seed=5))  # drawn again, not the cached
    c = task.problems("train", 200, seed=6)
    assert a == b
    assert [p.prompt for p in a] != [p.prompt for p in c]
    rng1, rng2 = random.Random(1), random.Random(1)
    assert [task.demonstration(p, rng1, True) for p in a[:50]] == [
        task.demonstration(p, rng2, True) for p in a[:50]
    ]


@pytest.mark.parametrize("name", TASKS)
def test_a_split_is_drawn_once_per_process_and_a_longer_one_answers_a_shorter_ask(name):
    drawn = make_task(name)._generate("train", 300, 7)
    first = make_task(name).problems("train", 300, 7)
    assert tuple(first) == drawn
    # the prefix property the cache relies on: the first 120 of 300 are the 120 drawn alone
    assert drawn[:120] == make_task(name)._generate("train", 120, 7)
    assert make_task(name).problems("train", 120, 7) == first[:120]
    first.clear()  # the caller's list is its own
    assert make_task(name).problems("train", 300, 7) == list(drawn)
    assert make_task(name).problems("test", 50, 7) != list(drawn[:50])  # the split is in the key
    if name == "arithmetic":  # another configuration is another key
        other = make_task(name, {"max_steps": 3}).problems("train", 300, 7)
        assert [p.prompt for p in other] != [p.prompt for p in drawn]


@pytest.mark.parametrize("name", TASKS)
def test_splits_are_disjoint(name):
    task = make_task(name)
    train = {p.prompt for p in task.problems("train", 5000, seed=0)}
    test = {p.prompt for p in task.problems("test", 500, seed=0)}
    assert len(test) == 500 and not train & test
    # another seed draws other problems but never crosses the split boundary
    test_other_seed = {p.prompt for p in task.problems("test", 500, seed=1)}
    assert not train & test_other_seed


@pytest.mark.parametrize("name", TASKS)
def test_demonstrations_verify_and_wrong_ones_fail(name):
    task = make_task(name)
    rng = random.Random(0)
    problems = task.problems("test", 300, seed=0)
    assert all(score(p, task.demonstration(p, rng)) == 1.0 for p in problems)
    wrong = sum(score(p, task.demonstration(p, rng, wrong=True)) for p in problems)
    # an op swap in Countdown can still hit the target by chance; arithmetic never can
    assert wrong <= (0 if name == "arithmetic" else 0.02 * len(problems))


def test_arithmetic_lengths_have_a_tail_and_follow_difficulty():
    easy = make_task("arithmetic", {"max_steps": 3})
    hard = make_task("arithmetic", {"min_steps": 4, "max_steps": 16, "tail": 0.8})
    rng = random.Random(0)

    def lengths(task):
        return sorted(len(task.demonstration(p, rng)) for p in task.problems("train", 500, 0))

    e, h = lengths(easy), lengths(hard)
    assert max(e) < min(h) or sum(h) / len(h) > 2 * sum(e) / len(e)
    median, p99 = h[len(h) // 2], h[int(0.99 * len(h))]
    assert p99 > 1.8 * median  # a long tail


def test_unknown_task_and_bad_params_are_clear():
    with pytest.raises(RelayError, match="unknown task 'aritmetic'.*did you mean 'arithmetic'"):
        make_task("aritmetic")
    with pytest.raises(RelayError, match="bad parameters for task 'arithmetic'.*max_stepz"):
        make_task("arithmetic", {"max_stepz": 3})


@pytest.mark.parametrize(
    "completion, correct",
    [
        ("17+5=22\n#### 22", True),
        ("#### 22.", True),
        ("#### 22\n", True),
        ("#### 12 #### 22", False),  # two markers: ambiguous
        ("#### 22\n#### 22", False),
        ("17+5=22", False),  # no answer line
        ("I think the answer is 22.", False),  # buried in prose, no marker
        ("#### 22 apples", False),
        ("#### 1000000000000000000000000000000022", False),  # huge number
        ("#### " + "9" * 5000, False),  # absurdly long, refused without parsing
        ("#### ２２", False),  # fullwidth digits
        ("#### ٢٢", False),  # Arabic-Indic digits
        ("#### -22", False),
        ("", False),
    ],
)
def test_math_verifier_adversarial(completion, correct):
    assert grade_math(completion, "22") is correct


@pytest.mark.parametrize(
    "completion, correct",
    [
        ("7*3=21\n21+12=33\n#### (7*3)+12", True),
        ("#### 12+7*3", True),
        ("#### 12+7*3 = 33", True),
        ("#### (7*3)+12+3", False),  # reuses 3
        ("#### 7*3+12*1", False),  # a number not given
        ("#### 7*3+13-1", False),
        ("#### 7+3+12", False),  # wrong value
        ("#### 33", False),  # uses none of the numbers
        ("#### 7*3", False),  # leaves 12 out
        ("#### __import__('os').system('true')", False),
        ("#### 7**3", False),
        ("#### (7*3)+12\n#### 33", False),
        ("no answer", False),
    ],
)
def test_countdown_verifier(completion, correct):
    assert verify_countdown(completion, [3, 7, 12], 33) is correct


def test_countdown_division_is_exact():
    assert evaluate_expression("7/2*4")[0] == 14
    assert verify_countdown("#### (8/3)*3", [3, 3, 8], 8)
    assert not verify_countdown("#### 8/0+3", [0, 3, 8], 3)
