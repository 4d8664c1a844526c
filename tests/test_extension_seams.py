"""The extension seams, used from outside the package as a user would: a new policy loss, a
new advantage estimator, a new task, a new grader and a new rollout workflow are each one
class (or function) plus one registry line, and the rest of relayrl picks them up by name."""

from __future__ import annotations

import random
from dataclasses import dataclass, replace

import pytest
import torch

from relayrl.algo.advantages import ADVANTAGES, AdvantageEstimator, register_advantage
from relayrl.algo.losses import (
    LOSSES,
    LossConfig,
    PolicyLoss,
    TokenInputs,
    TokenLoss,
    policy_loss,
    register_loss,
)
from relayrl.config.loader import load_config
from relayrl.errors import RelayError
from relayrl.rewards.dispatch import GRADERS, grade_detail, register_grader
from relayrl.rollout.controller import ControllerOptions, assign_advantages
from relayrl.rollout.trajectory import Trajectory
from relayrl.rollout.workflow import (
    WORKFLOWS,
    GroupRequest,
    RolloutServices,
    RolloutWorkflow,
    Sample,
    register_workflow,
    trajectory_of,
)
from relayrl.tasks.base import Problem, SyntheticTask
from relayrl.tasks.registry import TASKS, make_task, register_task
from tests.buffer.test_replay_training import make_trainer, params, synthetic_groups
from tests.rollout.test_controller import FakeReward, FakeServers, make_controller, one_batch


class VanillaPG(PolicyLoss):
    """REINFORCE on the sampled tokens: ℓ = −A · log π_θ (no ratio, no clip)."""

    name = "test_vanilla_pg"

    def token_loss(self, inputs: TokenInputs, cfg: LossConfig) -> TokenLoss:
        none = torch.zeros_like(inputs.mask, dtype=torch.bool)
        per_token = -inputs.advantages * inputs.logprobs
        ratio = torch.ones_like(inputs.logprobs)
        return TokenLoss(per_token, ratio, none, none, anchor=inputs.logprobs.detach())


class SignAdvantage(AdvantageEstimator):
    """+1 above the group mean, −1 below, 0 at it."""

    name = "test_sign"

    def compute(self, rewards_by_group, eps):
        out = []
        for group in rewards_by_group:
            mean = sum(group) / len(group)
            out.append([float((r > mean) - (r < mean)) for r in group])
        return out


@pytest.fixture(autouse=True)
def registered():
    register_loss(VanillaPG)
    register_advantage(SignAdvantage)
    yield
    LOSSES.pop(VanillaPG.name)
    ADVANTAGES.pop(SignAdvantage.name)


def test_a_registered_loss_is_a_config_value_and_gets_its_gradient():
    config = load_config(None, [f"algo.loss={VanillaPG.name}"])
    assert config.algo.loss == VanillaPG.name
    logp = torch.tensor([[-1.0, -2.0, -0.5]], requires_grad=True)
    adv = torch.tensor([[2.0, 2.0, 2.0]])
    mask = torch.tensor([[1.0, 1.0, 0.0]])
    out = policy_loss(logp, logp.detach() - 0.3, adv, mask, LossConfig(loss=VanillaPG.name), 4.0)
    out.loss.backward()
    # d/dlogp of Σ −A·logp / 4 over the two masked tokens; the padded one gets nothing
    assert torch.equal(logp.grad, torch.tensor([[-0.5, -0.5, 0.0]]))
    assert out.loss.item() == pytest.approx(-(2.0 * -1.0 + 2.0 * -2.0) / 4.0)


def test_the_trainer_runs_a_registered_loss_without_a_proximal_pass(tiny_model_dir):
    """REINFORCE and PPO have the same gradient where μ = π_θ (ratio 1, nothing clipped):
    the same step with each gives the same weights."""
    updated = []
    for loss in (VanillaPG.name, "ppo"):
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


def test_unknown_names_list_the_registered_ones():
    with pytest.raises(RelayError, match=r"unknown loss 'nope'.*test_vanilla_pg"):
        load_config(None, ["algo.loss=nope"])
    with pytest.raises(RelayError, match=r"unknown advantage method 'nope'.*test_sign"):
        load_config(None, ["algo.advantage=nope"])
    with pytest.raises(ValueError, match="already registered"):

        class Impostor(PolicyLoss):
            name = "ppo"

        register_loss(Impostor)


def test_a_registered_advantage_is_what_the_controller_assigns():
    assert load_config(None, [f"algo.advantage={SignAdvantage.name}"]).algo.advantage == (
        SignAdvantage.name
    )
    groups = [
        [Trajectory("p", "g0", j, [1], [2], [-0.1], [0], 0, reward=r) for j, r in enumerate(rs)]
        for rs in ([1.0, 0.0, 0.0], [0.5, 0.5])
    ]
    assign_advantages(groups, SignAdvantage.name)
    assert [[t.advantage for t in g] for g in groups] == [[1.0, -1.0, -1.0], [0.0, 0.0]]


@dataclass
class Parity(SyntheticTask):
    """Is the number even? Problems name a grader registered below."""

    name: str = "test_parity"

    def _sample(self, rng: random.Random, problem_id: str) -> tuple[str, Problem]:
        n = rng.randrange(10**6)
        answer = "even" if n % 2 == 0 else "odd"
        return str(n), Problem(problem_id, f"Is {n} even or odd?", answer, "test_word")

    def demonstration(self, problem: Problem, rng: random.Random, wrong: bool = False) -> str:
        flip = {"even": "odd", "odd": "even"}
        return f"#### {flip[problem.answer] if wrong else problem.answer}"


def _grade_word(problem: Problem, completion: str) -> tuple[float, dict]:
    said = completion.rsplit("####", 1)[-1].strip()
    return float(said == problem.answer), {"extracted": said}


def test_a_registered_task_and_grader_work_by_name():
    register_task(Parity)
    register_grader("test_word")(_grade_word)
    try:
        task = make_task("test_parity")
        problems = task.problems("test", 20, seed=0)
        rng = random.Random(0)
        right = [grade_detail(p, task.demonstration(p, rng))[0] for p in problems]
        wrong = [grade_detail(p, task.demonstration(p, rng, wrong=True))[0] for p in problems]
        assert right == [1.0] * 20 and wrong == [0.0] * 20
        assert load_config(None, ["task.name=test_parity"]).task.name == "test_parity"
    finally:
        TASKS.pop("test_parity")
        GRADERS.pop("test_word")
    with pytest.raises(RelayError, match="unknown grader 'test_word'"):
        grade_detail(problems[0], "#### even")


class GreedyFirstWorkflow(RolloutWorkflow):
    """Sample 0 of every group at temperature 0, the rest as asked; reward = 1 for an even
    number of completion tokens."""

    name = "test_greedy_first"

    async def run_group(self, request: GroupRequest, services: RolloutServices) -> list[Sample]:
        sampling = [replace(request.sampling[0], temperature=0.0), *request.sampling[1:]]
        gens = await services.generate_group(request.prompt_ids, sampling, request.key)
        self.temperatures = [p.temperature for p in sampling]
        samples = []
        for j, gen in enumerate(gens):
            grade = FakeReward(float(len(gen.output_ids) % 2 == 0))
            samples.append(Sample(trajectory_of(request, j, gen, grade, {}), "", 0))
        return samples


def test_a_registered_workflow_runs_under_the_controller():
    register_workflow(GreedyFirstWorkflow)
    try:
        config = load_config(None, [f"rollout.workflow={GreedyFirstWorkflow.name}"])
        workflow = WORKFLOWS.lookup(config.rollout.workflow)()
        options = ControllerOptions(
            n_samples=3, prompts_per_step=2, eta=0, max_new_tokens=8, temperature=0.7
        )
        servers = FakeServers(random.Random(0))
        ctrl = make_controller(servers, options, lambda p, t: FakeReward(0.0))
        ctrl.workflow = workflow
        batch = one_batch(ctrl)
    finally:
        WORKFLOWS.pop(GreedyFirstWorkflow.name)
    assert workflow.temperatures == [0.0, 0.7, 0.7]
    for group in batch:
        rewards = [t.reward for t in group.trajectories]
        assert rewards == [float(len(t.completion_ids) % 2 == 0) for t in group.trajectories]
        # the controller still computes advantages over the batch
        assert sum(t.advantage for t in group.trajectories) == pytest.approx(0.0, abs=1e-6)
