"""The extension seams, used from outside the package as a user would: docs/extending.md's
examples (a policy loss, an advantage estimator, a task and its grader, a rollout workflow)
are pasted unchanged into a module outside the package, imported, and then picked up by
name by the rest of relayrl."""

from __future__ import annotations

import importlib.util
import random
import re
import sys
from pathlib import Path
from types import ModuleType

import pytest
import torch
from pydantic import create_model

from relayrl.algo.advantages import ADVANTAGES
from relayrl.algo.losses import LOSSES, LossConfig, PolicyLoss, policy_loss, register_loss
from relayrl.algo.params import ObjectiveParams
from relayrl.config.loader import load_config
from relayrl.config.reference import config_reference
from relayrl.errors import RelayError
from relayrl.rewards.dispatch import GRADERS, grade_detail
from relayrl.rollout.controller import ControllerOptions, assign_advantages
from relayrl.rollout.eta import StalenessBound
from relayrl.rollout.trajectory import Trajectory
from relayrl.rollout.workflow import WORKFLOWS
from relayrl.tasks.registry import TASKS, make_task
from relayrl.train.options import TrainerOptions
from relayrl.train.run.rollout import controller_options
from tests.buffer.test_replay_training import make_trainer, params, synthetic_groups
from tests.rollout.test_controller import FakeReward, FakeServers, make_controller, one_batch

DOC = Path(__file__).resolve().parents[1] / "docs" / "extending.md"
SECTIONS = (
    "A policy loss",
    "An advantage estimator",
    "A task and its grader",
    "A rollout workflow",
)


def doc_block(heading: str) -> str:
    """The first python block under ``## heading`` of docs/extending.md, as written."""
    section = DOC.read_text().split(f"## {heading}\n", 1)[1].split("\n## ", 1)[0]
    return re.search(r"```python\n(.*?)```", section, re.S).group(1)


@pytest.fixture(scope="module")
def doc(tmp_path_factory) -> ModuleType:
    """The doc's blocks in one user module outside the package, imported; the registries
    are restored afterwards so other tests see only the built-in names."""
    registries = (LOSSES, ADVANTAGES, TASKS, GRADERS, WORKFLOWS)
    saved = [dict(r) for r in registries]
    path = tmp_path_factory.mktemp("user") / "my_extensions.py"
    path.write_text("\n\n".join(doc_block(h) for h in SECTIONS))
    spec = importlib.util.spec_from_file_location("my_extensions", path)
    module = importlib.util.module_from_spec(spec)
    sys.modules["my_extensions"] = module
    spec.loader.exec_module(module)
    yield module
    sys.modules.pop("my_extensions", None)
    for registry, before in zip(registries, saved, strict=True):
        registry.clear()
        registry.update(before)


def test_a_registered_loss_is_a_config_value_and_gets_its_gradient(doc):
    config = load_config(None, ["algo.loss=vanilla_pg"])
    assert config.algo.loss == "vanilla_pg"
    logp = torch.tensor([[-1.0, -2.0, -0.5]], requires_grad=True)
    adv = torch.tensor([[2.0, 2.0, 2.0]])
    mask = torch.tensor([[1.0, 1.0, 0.0]])
    out = policy_loss(logp, logp.detach() - 0.3, adv, mask, LossConfig(loss="vanilla_pg"), 4.0)
    out.loss.backward()
    # d/dlogp of Σ −A·logp / 4 over the two masked tokens; the padded one gets nothing
    assert torch.equal(logp.grad, torch.tensor([[-0.5, -0.5, 0.0]]))
    assert out.loss.item() == pytest.approx(-(2.0 * -1.0 + 2.0 * -2.0) / 4.0)


def test_a_plugin_loss_parameter_is_an_algo_key_that_reaches_the_loss(doc):
    """``VanillaPG.Params`` makes ``algo.vanilla_pg_baseline``: listed by the reference,
    shown by the resolved config, and the b the trainer's loss subtracts from A."""
    assert "| `algo.vanilla_pg_baseline` | float | `0.0` | (loss=vanilla_pg only) b," in (
        config_reference()
    )
    config = load_config(None, ["algo.loss=vanilla_pg", "algo.vanilla_pg_baseline=1.5"])
    assert config.model_dump()["algo"]["vanilla_pg_baseline"] == 1.5
    cfg = TrainerOptions.from_config(config).loss
    logp = torch.tensor([[-1.0, -2.0, -0.5]], requires_grad=True)
    adv, mask = torch.tensor([[2.0, 2.0, 2.0]]), torch.tensor([[1.0, 1.0, 0.0]])
    policy_loss(logp, logp.detach(), adv, mask, cfg, 4.0).loss.backward()
    assert torch.equal(logp.grad, torch.tensor([[-0.125, -0.125, 0.0]]))  # −(2 − 1.5)/4
    with pytest.raises(RelayError, match="vanilla_pg_baseline=1.5 is a parameter of the loss"):
        load_config(None, ["algo.vanilla_pg_baseline=1.5"])  # algo.loss=decoupled
    with pytest.raises(RelayError, match="did you mean 'algo.vanilla_pg_baseline'"):
        load_config(None, ["algo.loss=vanilla_pg", "algo.vanilla_pg_baselin=1"])


def test_a_plugin_advantage_parameter_reaches_the_controller(doc):
    config = load_config(None, ["algo.advantage=sign", "algo.sign_margin=0.5"])
    options = controller_options(config)
    groups = [
        [Trajectory("p", "g0", j, [1], [2], [-0.1], [0], 0, reward=r) for j, r in enumerate(rs)]
        for rs in ([1.0, 0.0, 0.0], [0.9, 0.0])
    ]
    assign_advantages(groups, options.advantage, options.gamma, options.advantage_params)
    # means 1/3 and 0.45: only the reward 1.0 is more than the margin 0.5 away
    assert [[t.advantage for t in g] for g in groups] == [[1.0, 0.0, 0.0], [0.0, 0.0]]
    with pytest.raises(RelayError, match=r"algo.sign_margin = -1 is invalid"):
        load_config(None, ["algo.advantage=sign", "algo.sign_margin=-1"])


def test_the_trainer_runs_a_registered_loss_without_a_proximal_pass(doc, tiny_model_dir):
    """REINFORCE and PPO have the same gradient where μ = π_θ (ratio 1, nothing clipped):
    the same step with each gives the same weights."""
    updated = []
    for loss in ("vanilla_pg", "ppo"):
        trainer = make_trainer(tiny_model_dir, f"algo.loss={loss}", "rollout.eta=0")
        groups = synthetic_groups(trainer, seed=1, lags=[0, 0])
        trajs = [t for g in groups for t in g]
        for t, lp in zip(trajs, trainer.traj_logprobs(trainer.model, trajs), strict=True):
            t.behav_logprobs = lp.tolist()
        stats = trainer.train_step(groups)
        assert "is_weight_mean" not in stats  # neither weights by π_prox/μ
        updated.append(params(trainer))
    base = params(make_trainer(tiny_model_dir))
    assert max((a - b).abs().max().item() for a, b in zip(updated[0], base, strict=True)) > 1e-5
    for a, b in zip(*updated, strict=True):
        torch.testing.assert_close(a, b, rtol=0, atol=1e-7)


def test_unknown_names_list_the_registered_ones(doc):
    with pytest.raises(RelayError, match=r"unknown loss 'nope'.*vanilla_pg"):
        load_config(None, ["algo.loss=nope"])
    with pytest.raises(RelayError, match=r"unknown advantage method 'nope'.*sign"):
        load_config(None, ["algo.advantage=nope"])
    with pytest.raises(ValueError, match="already registered"):

        class Impostor(PolicyLoss):
            name = "ppo"

        register_loss(Impostor)


def test_a_registered_advantage_is_what_the_controller_assigns(doc):
    assert load_config(None, ["algo.advantage=sign"]).algo.advantage == "sign"
    groups = [
        [Trajectory("p", "g0", j, [1], [2], [-0.1], [0], 0, reward=r) for j, r in enumerate(rs)]
        for rs in ([1.0, 0.0, 0.0], [0.5, 0.5])
    ]
    assign_advantages(groups, "sign")
    assert [[t.advantage for t in g] for g in groups] == [[1.0, -1.0, -1.0], [0.0, 0.0]]


def test_a_registered_task_and_grader_work_by_name(doc):
    task = make_task("parity")
    problems = task.problems("test", 20, seed=0)
    rng = random.Random(0)
    right = [grade_detail(p, task.demonstration(p, rng))[0] for p in problems]
    wrong = [grade_detail(p, task.demonstration(p, rng, wrong=True))[0] for p in problems]
    assert right == [1.0] * 20 and wrong == [0.0] * 20
    assert {p.grader for p in problems} == {"word"}
    assert load_config(None, ["task.name=parity"]).task.name == "parity"


def test_an_unregistered_grader_is_an_error_not_a_zero(doc):
    problem = make_task("parity").problems("test", 1, seed=0)[0]
    grader = GRADERS.pop("word")
    try:
        with pytest.raises(RelayError, match="unknown grader 'word'"):
            grade_detail(problem, "#### even")
    finally:
        GRADERS["word"] = grader


def test_a_registered_workflow_runs_under_the_controller(doc):
    """The doc's workflow, looked up by the config's name as the run does, samples the first
    of each group greedily; the controller around it still grades and assigns advantages."""
    config = load_config(None, ["rollout.workflow=greedy_first"])
    options = ControllerOptions(
        n_samples=3,
        prompts_per_step=2,
        staleness=StalenessBound(0),
        max_new_tokens=8,
        temperature=0.7,
        dynamic_sampling=False,
    )
    servers = FakeServers(random.Random(0))
    seen = []

    async def generate(ids, params, key):
        seen.append(params.temperature)
        return await servers.generate(ids, params, key)

    ctrl = make_controller(
        servers, options, lambda p, t: FakeReward(float(len(t) % 2 == 0)), generate=generate
    )
    ctrl.workflow = WORKFLOWS.lookup(config.rollout.workflow)()
    batch = one_batch(ctrl)
    assert type(ctrl.workflow).__module__ == "my_extensions"
    # one greedy sample per group, the rest at the configured temperature
    assert len(seen) % 3 == 0 and seen.count(0.0) == len(seen) // 3
    assert set(seen) == {0.0, 0.7}
    for group in batch:
        assert sum(t.advantage for t in group.trajectories) == pytest.approx(0.0, abs=1e-6)


@pytest.mark.parametrize("taken", ["cispo_cap", "eps_low"])
def test_a_parameter_name_two_objectives_declare_is_refused(taken):
    """Every objective's parameters share the ``algo`` section: a plugin's parameter named
    like another loss's (``cispo_cap``) or a shared key (``eps_low``) fails at load."""
    saved = dict(LOSSES)
    params = create_model("Params", __base__=ObjectiveParams, **{taken: (float, 1.0)})
    register_loss(type("Clashing", (PolicyLoss,), {"name": "clashing", "Params": params}))
    try:
        with pytest.raises(RelayError, match=f"loss 'clashing' declares the parameter '{taken}'"):
            load_config(None, [])
    finally:
        LOSSES.clear()
        LOSSES.update(saved)
