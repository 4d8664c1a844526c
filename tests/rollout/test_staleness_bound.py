"""``StalenessBound``: ``rollout.eta`` as a run uses it (fixed or auto) — the admission
capacities it starts the controller at, the hard bound a restored group is checked
against, and the rule it builds — and ``auto`` is compared for η in its module only."""

from __future__ import annotations

import ast
import random
from pathlib import Path

import pytest

import relayrl
from relayrl.config.loader import load_config
from relayrl.errors import RelayError
from relayrl.rollout.controller import ControllerOptions, admission_capacity
from relayrl.rollout.eta import AUTO, INITIAL_ETA, StalenessBound
from relayrl.train.options import TrainerOptions
from tests.rollout.test_controller import FakeServers, make_controller
from tests.rollout.test_controller_resume import state_at

B = 3  # prompts per step


def options(bound: StalenessBound) -> ControllerOptions:
    return ControllerOptions(
        n_samples=2,
        prompts_per_step=B,
        staleness=bound,
        max_new_tokens=8,
        dynamic_sampling=False,
    )


def test_fixed_bound_admits_p_plus_eta_plus_one_steps_and_checks_eta():
    bound = StalenessBound(2)
    assert (bound.auto, bound.initial, bound.hard, bound.rule()) == (False, 2, 2, None)
    ctrl = make_controller(FakeServers(random.Random(0)), options(bound), None)
    assert ctrl.capacity() == admission_capacity(0, 2, B) == (0 + 2 + 1) * 3 == 9
    ctrl.set_published_version(5)
    assert ctrl.capacity() == (5 + 2 + 1) * 3 == 24


def test_auto_bound_admits_from_one_and_checks_eta_max():
    bound = StalenessBound(AUTO, eta_max=6, budget=1e-3)
    assert (bound.auto, bound.initial, bound.hard) == (True, INITIAL_ETA, 6) == (True, 1, 6)
    rule = bound.rule()
    assert rule is not None and (rule.eta, rule.eta_max, rule.budget) == (1, 6, 1e-3)
    ctrl = make_controller(FakeServers(random.Random(0)), options(bound), None)
    assert ctrl.capacity() == admission_capacity(0, 1, B) == (0 + 1 + 1) * 3 == 6
    ctrl.set_eta(4)  # the rule moved the bound: admission follows, the hard bound does not
    ctrl.set_published_version(5)
    assert ctrl.capacity() == (5 + 4 + 1) * 3 == 30
    assert ctrl.opt.staleness.hard == 6


def test_a_restored_group_is_checked_against_the_hard_bound():
    """A checkpoint of a run at η = 2 holds a group of staleness 2 (by its trainer version):
    a fixed η = 1 refuses it, auto with eta_max = 2 takes it though it admits from η = 1."""
    state = state_at(eta=2, stop_at=3, seed=0)
    for bound, refused in ((StalenessBound(1), True), (StalenessBound(AUTO, eta_max=2), False)):
        ctrl = make_controller(FakeServers(random.Random(0)), options(bound), None)
        if refused:
            with pytest.raises(RelayError, match="above rollout.eta=1: it must not be trained"):
                ctrl.load_state_dict(state)
        else:
            ctrl.load_state_dict(state)
            assert ctrl.eta == 1 and ctrl.ready_groups > 0


def test_the_config_and_the_trainer_read_the_same_bound():
    for overrides, hard, auto in (
        (["rollout.eta=3"], 3, False),
        (["rollout.eta=0", "rollout.eta_max=7"], 0, False),  # eta_max only with auto
        (["rollout.eta=auto", "rollout.eta_max=7"], 7, True),
    ):
        config = load_config(None, overrides)
        assert (config.rollout.staleness.hard, config.rollout.staleness.auto) == (hard, auto)
        trainer = TrainerOptions.from_config(config)
        assert (trainer.eta, trainer.stale_kl) == (hard, auto)


@pytest.mark.parametrize("bad", ["fast", -1, 2.5, True])
def test_settings_that_are_not_a_bound_are_refused(bad):
    with pytest.raises(ValueError, match="non-negative integer or 'auto'"):
        StalenessBound(bad)  # type: ignore[arg-type]


def _auto_comparisons_for_eta(tree: ast.AST) -> list[int]:
    """Lines comparing ``"auto"`` (the literal or the name ``AUTO``) with a name or
    attribute that mentions eta."""

    def name_of(node: ast.expr) -> str:
        return node.attr if isinstance(node, ast.Attribute) else getattr(node, "id", "")

    def is_auto(node: ast.expr) -> bool:
        return getattr(node, "value", None) == AUTO or name_of(node) == "AUTO"

    lines = []
    for node in ast.walk(tree):
        if not isinstance(node, ast.Compare):
            continue
        operands = [node.left, *node.comparators]
        if any(map(is_auto, operands)) and any("eta" in name_of(o).lower() for o in operands):
            lines.append(node.lineno)
    return lines


def test_auto_is_compared_for_eta_in_one_module_only():
    root = Path(relayrl.__file__).parent
    found = {
        str(path.relative_to(root.parent)): lines
        for path in sorted(root.rglob("*.py"))
        if (lines := _auto_comparisons_for_eta(ast.parse(path.read_text())))
    }
    assert list(found) == ["relayrl/rollout/eta.py"], found
    assert len(found["relayrl/rollout/eta.py"]) == 1  # in is_auto
    # the check sees the comparisons is_auto replaced
    for before in ('stale_kl = config.rollout.eta == "auto"', "(1, 0) if eta == AUTO else 0"):
        assert _auto_comparisons_for_eta(ast.parse(before))
