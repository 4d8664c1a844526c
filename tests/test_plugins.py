"""Plugins: user code named by ``--plugin`` / ``plugins:`` is imported in every process that
resolves registered names (the CLI, grading workers, trainer ranks, servers) before the
config is validated; a grader unknown to a grading worker is a loud error, a grader that
raises is counted and its first error printed."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from relayrl import plugins
from relayrl.config.loader import load_config
from relayrl.errors import RelayError
from relayrl.rewards.dispatch import GRADERS, register_grader
from relayrl.rewards.pool import GradingPool
from relayrl.tasks.base import Problem

ROOT = Path(__file__).resolve().parents[1]

# docs/extending.md's task, grader and loss, as a user's own file
USER_MODULE = textwrap.dedent(
    '''
    """A user's module: a task, its grader and a loss, registered on import."""
    import random
    from dataclasses import dataclass

    import torch

    from relayrl.algo.losses import LossConfig, PolicyLoss, TokenInputs, TokenLoss, register_loss
    from relayrl.rewards.dispatch import register_grader
    from relayrl.tasks.base import Problem, SyntheticTask
    from relayrl.tasks.registry import register_task

    CALLS = {"grader": 0}


    @register_task
    @dataclass
    class Parity(SyntheticTask):
        name: str = "parity"

        def _sample(self, rng: random.Random, problem_id: str) -> tuple[str, Problem]:
            n = rng.randrange(10**6)
            answer = "even" if n % 2 == 0 else "odd"
            return str(n), Problem(problem_id, f"Is {n} even or odd?", answer, grader="word")

        def demonstration(self, problem, rng, wrong=False) -> str:
            flip = {"even": "odd", "odd": "even"}
            return f"#### {flip[problem.answer] if wrong else problem.answer}"


    @register_grader("word", safe=True)
    def grade_word(problem: Problem, completion: str) -> tuple[float, dict]:
        said = completion.rsplit("####", 1)[-1].strip()
        return float(said == problem.answer), {"extracted": said}


    @register_loss
    class VanillaPG(PolicyLoss):
        name = "vanilla_pg"
        needs_prox = False

        def token_loss(self, inputs: TokenInputs, cfg: LossConfig) -> TokenLoss:
            never = torch.zeros_like(inputs.mask, dtype=torch.bool)
            return TokenLoss(
                per_token=-inputs.advantages * inputs.logprobs,
                ratio=torch.ones_like(inputs.logprobs),
                clip_hit=never,
                dual_hit=never,
                anchor=inputs.logprobs.detach(),
            )
    '''
)


@pytest.fixture
def clean_env():
    """No RELAYRL_PLUGINS during the test, and none leaking from it into later tests (their
    grading workers and servers would import these files)."""
    saved = os.environ.pop(plugins.ENV, None)
    yield
    os.environ.pop(plugins.ENV, None)
    if saved is not None:
        os.environ[plugins.ENV] = saved


def test_a_file_plugin_is_imported_once_and_recorded_for_children(tmp_path, clean_env):
    path = tmp_path / "i31_plugin_once.py"
    path.write_text("COUNT = globals().get('COUNT', 0) + 1\n")
    first = plugins.load_plugins([str(path)])
    again = plugins.load_plugins([str(path)])
    assert first == again == [str(path.resolve())]
    assert sys.modules["i31_plugin_once"].COUNT == 1  # executed once
    assert json.loads(os.environ[plugins.ENV]) == [str(path.resolve())]
    assert plugins.plugin_environment() == {plugins.ENV: os.environ[plugins.ENV]}


def test_plugin_errors_name_the_plugin(tmp_path, clean_env):
    with pytest.raises(RelayError, match=r"plugin 'no_such_module_xyz': no such module"):
        plugins.load_plugins(["no_such_module_xyz"])
    with pytest.raises(RelayError, match="no such file"):
        plugins.load_plugins([str(tmp_path / "absent.py")])
    broken = tmp_path / "i31_broken_plugin.py"
    broken.write_text("raise RuntimeError('boom in user code')\n")
    with pytest.raises(RelayError, match="import failed: boom in user code"):
        plugins.load_plugins([str(broken)])
    assert "i31_broken_plugin" not in sys.modules
    os.environ[plugins.ENV] = "not json"
    with pytest.raises(RelayError, match="must be a JSON list"):
        plugins.env_plugins()


def test_task_name_is_checked_at_load_with_the_plugins_names(tmp_path, clean_env):
    with pytest.raises(RelayError, match=r"unknown task 'arithmetc' \(did you mean 'arithmetic'"):
        load_config(None, ["task.name=arithmetc"])
    module = tmp_path / "i31_user_seams.py"
    module.write_text(USER_MODULE)
    config = load_config(None, ["task.name=parity", "algo.loss=vanilla_pg"], plugins=[str(module)])
    assert config.plugins == [str(module.resolve())]
    assert config.task.name == "parity" and config.algo.loss == "vanilla_pg"
    with pytest.raises(RelayError, match=r"did you mean 'parity'"):
        load_config(None, ["task.name=parit"])


PARAM_LOSS = textwrap.dedent(
    """
    from pydantic import Field

    from relayrl.algo.losses import PPOLoss, register_loss
    from relayrl.algo.params import ObjectiveParams


    @register_loss
    class ScaledPPO(PPOLoss):
        # PPO with a parameter of its own, declared only here
        name = "scaled_ppo"

        class Params(ObjectiveParams):
            scaled_ppo_scale: float = Field(1.0, gt=0, description="a parameter of its own")
    """
)


@pytest.mark.parametrize("how", ["flag", "override", "file"])
def test_a_plugins_loss_parameter_is_a_key_before_the_plugin_is_imported(tmp_path, how, clean_env):
    """The key a plugin's loss declares (``algo.scaled_ppo_scale``) is checked only once the
    plugin is imported: the loader imports the plugins a config names before its keys."""
    from relayrl.algo.losses import LOSSES

    module = tmp_path / f"i46_scaled_ppo_{how}.py"  # --plugin, plugins=[...], plugins: [...]
    module.write_text(PARAM_LOSS)
    keys = ["algo.loss=scaled_ppo", "algo.scaled_ppo_scale=2"]
    saved = dict(LOSSES)
    try:
        if how == "flag":
            config = load_config(None, keys, plugins=[str(module)])
        elif how == "override":
            config = load_config(None, [f"plugins=[{module}]", *keys])
        else:
            path = tmp_path / "run.yaml"
            path.write_text(
                f"plugins: [{module}]\nalgo: {{loss: scaled_ppo, scaled_ppo_scale: 2}}\n"
            )
            config = load_config(path)
        assert config.algo.params_of("loss").scaled_ppo_scale == 2.0
    finally:
        LOSSES.clear()
        LOSSES.update(saved)


def test_a_task_whose_grader_nobody_registered_fails_at_load(tmp_path, clean_env):
    module = tmp_path / "i31_no_grader.py"
    module.write_text(
        USER_MODULE.replace('name: str = "parity"', 'name: str = "parity_ng"')
        .replace('grader="word"', 'grader="never_registered"')
        .replace('@register_grader("word", safe=True)', "")
        .replace("@register_loss", "")
    )
    with pytest.raises(RelayError, match="grades with 'never_registered', which no module"):
        load_config(None, ["task.name=parity_ng", f"plugins=[{module}]"])


@register_grader("i31_parent_only")
def _parent_only(problem: Problem, completion: str) -> tuple[float, dict]:
    return 1.0, {}


def test_a_grader_missing_in_the_workers_is_a_loud_error(clean_env):
    """Registered here only (this test module is not a plugin): the spawned worker does not
    know it, and the item raises instead of scoring 0."""
    assert "i31_parent_only" in GRADERS
    problem = Problem("p0", "q", "1", grader="i31_parent_only")
    with GradingPool(workers=1, timeout_s=60) as pool:
        with pytest.raises(RelayError, match="unknown grader 'i31_parent_only'.*plugin"):
            pool.grade_batch([(problem, "x")])
        assert pool.stats()["error"] == 0


def test_a_grader_that_raises_is_counted_and_its_first_error_printed_once(
    capfd, tmp_path, clean_env
):
    module = tmp_path / "i31_raising_grader.py"
    module.write_text(
        "from relayrl.rewards.dispatch import register_grader\n"
        "@register_grader('i31_raises')\n"
        "def bad(problem, completion):\n"
        "    raise ValueError(f'cannot read {completion!r}')\n"
    )
    os.environ[plugins.ENV] = json.dumps([str(module)])  # only the workers import it
    problems = [Problem(f"p{i}", "q", "1", grader="i31_raises") for i in range(3)]
    with GradingPool(workers=1, timeout_s=60) as pool:
        results = pool.grade_batch([(p, f"c{i}") for i, p in enumerate(problems)])
        stats = pool.stats()
    assert [r.status for r in results] == ["error"] * 3 and stats["error"] == 3
    err = capfd.readouterr().err
    assert err.count("a grader raised") == 1
    assert "problem 'p0' (grader 'i31_raises'): ValueError: cannot read 'c0'" in err


def test_train_uses_a_user_modules_task_grader_and_loss(tmp_path, tiny_model_dir):
    """As a user would: their own file in their own directory, `relayrl train --plugin`; the
    rollout server, the grading workers and trainer rank 1 (a process of its own,
    train.world_size=2) all resolve the names."""
    user = tmp_path / "user"
    user.mkdir()
    (user / "parity_plugin.py").write_text(USER_MODULE)
    (user / "run.yaml").write_text(
        textwrap.dedent(
            f"""\
            name: run
            output_dir: {tmp_path / "runs"}
            task: {{name: parity}}
            model: {{path: {tiny_model_dir}, max_context: 128}}
            rollout: {{prompts_per_step: 2, n_samples: 4, max_new_tokens: 12}}
            algo: {{loss: vanilla_pg, dynamic_sampling: false}}
            train: {{total_steps: 2, eval_every: 0, progress: false, trainer_threads: 1,
                     world_size: 2}}
            eval: {{num_problems: 4, max_new_tokens: 12}}
            runtime: {{threads: 1}}
            """
        )
    )
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}
    env.pop(plugins.ENV, None)
    command = [sys.executable, "-m", "relayrl.cli", "train", "--plugin", "parity_plugin.py"]
    done = subprocess.run(
        [*command, "run.yaml"], cwd=user, env=env, capture_output=True, text=True, timeout=400
    )
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-3000:]
    assert "final_pass@1=" in done.stdout
    saved = (tmp_path / "runs" / "run" / "config.yaml").read_text()
    assert str(user / "parity_plugin.py") in saved  # a resume imports it again
    rows = (tmp_path / "runs" / "run" / "metrics.jsonl").read_text().splitlines()
    last = [json.loads(r) for r in rows if "grading_ok" in r][-1]
    assert last["grading_ok"] >= 8 and last["grading_error"] == 0, last


def test_processes_started_for_the_run_get_the_plugins(tmp_path, clean_env):
    """Rollout servers and trainer ranks (local children or a Ray actor's, on any node) are
    started with RELAYRL_PLUGINS, captured where the run is set up."""
    from relayrl.launch.servers import ServerSpec
    from relayrl.train.worker_ranks import rank_environment

    assert plugins.ENV not in ServerSpec("m").environment(0)
    path = tmp_path / "i31_env_plugin.py"
    path.write_text("")
    plugins.load_plugins([str(path)])
    spec = ServerSpec("m")
    os.environ.pop(plugins.ENV)  # e.g. a Ray actor on another node
    expected = json.dumps([str(path.resolve())])
    assert spec.environment(0)[plugins.ENV] == expected
    os.environ[plugins.ENV] = expected
    config = load_config(None, ["train.world_size=2"])
    assert rank_environment(config, 1, "127.0.0.1", 1234, "s")[plugins.ENV] == expected
