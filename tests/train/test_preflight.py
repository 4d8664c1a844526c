"""`relayrl check` / `relayrl train --check`: the good config passes (one real run, a real
server and a real step, shared by the module), and each crafted bad input fails its own
check with its own one-line message, fast (before any server starts where it can)."""

from __future__ import annotations

import contextlib
import io
import json
import shutil
import time
from pathlib import Path

import pytest

from relayrl.cli import main
from relayrl.plugins import ENV as PLUGINS_ENV
from relayrl.train.preflight.runner import Check, run_checks

REPO = Path(__file__).resolve().parents[2]
ASYNC = str(REPO / "configs" / "async.yaml")
NAMES = (
    "plugins config environment run_dir dataset sandbox grader model template server step memory"
)


def check(*argv: str) -> tuple[int, list[str]]:
    """``relayrl ARGV...``: its exit status and its output lines (stdout then stderr)."""
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        code = main(list(argv))
    return code, (out.getvalue() + err.getvalue()).splitlines()


def line_of(lines: list[str], name: str) -> str:
    prefixes = tuple(f"{p}{name}: " for p in ("ok   ", "skip ", "error: "))
    return next(ln for ln in lines if ln.startswith(prefixes))


@pytest.fixture(scope="module")
def passing(tmp_path_factory) -> tuple[int, list[str], float]:
    """configs/async.yaml as shipped (the preset built, a real server), run directory in a
    temporary folder."""
    out = tmp_path_factory.mktemp("runs")
    start = time.monotonic()
    code, lines = check("check", ASYNC, f"output_dir={out}")
    return code, lines, time.monotonic() - start


def test_the_good_config_passes_every_check(passing):
    code, lines, seconds = passing
    assert code == 0, "\n".join(lines)
    for name in NAMES.split():
        assert line_of(lines, name).startswith(f"ok   {name}: "), lines
    assert lines[-1] == "check: all passed"
    server = line_of(lines, "server")
    kl = float(server.split("k3 KL ")[1].split()[0])
    assert kl < 1e-6, server  # fp32 engine and trainer on the same weights
    assert "8 samples" in server
    step = line_of(lines, "step")
    assert "a step of 16 groups ≈" in step and "4 groups at once" in step, step
    assert "MiB available" in line_of(lines, "memory")
    assert seconds < 120, seconds  # the goal on an idle machine is 30 s (README)


def test_train_check_runs_the_same_and_does_not_train(tmp_path):
    code, lines = check(
        "train",
        ASYNC,
        "--check",
        f"output_dir={tmp_path}",
        "rollout.vllm.python=/no/python",
        "rollout.engine=vllm",
    )
    assert code == 1
    assert line_of(lines, "environment").startswith("error: environment: rollout.vllm.python")
    assert "make vllm" in line_of(lines, "environment")
    assert line_of(lines, "server").startswith("skip server:")
    assert not (tmp_path / "async").exists()  # nothing trained, no run directory made


def test_a_bad_override_fails_the_config_check():
    code, lines = check("check", ASYNC, "rollout.etaa=3")
    assert code == 1
    line = line_of(lines, "config")
    assert line.startswith("error: config: override 'rollout.etaa'"), line
    assert line_of(lines, "model").startswith("skip model:")


def test_a_plugin_that_fails_to_import(tmp_path):
    plugin = tmp_path / "broken_plugin.py"
    plugin.write_text("raise RuntimeError('no such dependency')\n")
    code, lines = check("check", ASYNC, "--plugin", str(plugin))
    assert code == 1
    line = line_of(lines, "plugins")
    assert line.startswith("error: plugins: plugin ") and "no such dependency" in line, line
    assert line.endswith("— fix the module or drop it from --plugin / plugins:")
    assert "Traceback" not in "\n".join(lines)  # one line, not the traceback


def test_a_model_path_that_is_not_a_model(tmp_path):
    (tmp_path / "empty").mkdir()
    code, lines = check(
        "check", ASYNC, f"model.path={tmp_path / 'empty'}", f"output_dir={tmp_path}"
    )
    assert code == 1
    failed = [ln for ln in lines if ln.startswith("error:")]
    assert len(failed) == 1 and "config.json" in failed[0], lines
    assert failed[0].startswith(("error: model:", "error: config:")), failed


def test_a_template_that_refuses_a_system_turn(tmp_path, tiny_model_dir):
    model = tmp_path / "model"
    shutil.copytree(tiny_model_dir, model)
    config_file = model / "tokenizer_config.json"
    tokenizer_config = json.loads(config_file.read_text())
    tokenizer_config["chat_template"] = (
        "{% for m in messages %}{% if m['role'] == 'system' %}"
        "{{ raise_exception('System role not supported') }}{% endif %}"
        "{{ m['content'] }}\n{% endfor %}"
    )
    config_file.write_text(json.dumps(tokenizer_config))
    code, lines = check(
        "check",
        ASYNC,
        f"model.path={model}",
        "model.system_prompt=Be brief.",
        f"output_dir={tmp_path}",
    )
    assert code == 1
    line = line_of(lines, "template")
    assert line.startswith("error: template: model.system_prompt: the tokenizer's chat template")
    assert "System role not supported" in line
    assert line_of(lines, "server").startswith("skip server:")


def test_a_dataset_row_missing_its_field(tmp_path):
    data = tmp_path / "rows.jsonl"
    rows = [{"id": "a", "prompt": "1+1?", "answer": "2"}, {"id": "b", "prompt": "2+2?"}]
    data.write_text("".join(json.dumps(r) + "\n" for r in rows))
    code, lines = check("check", ASYNC, f"rollout.dataset={data}", f"output_dir={tmp_path}")
    assert code == 1
    line = line_of(lines, "dataset")
    assert line.startswith("error: dataset: ") and f"{data}:2" in line and "answer" in line, line
    assert line_of(lines, "grader").startswith("skip grader:")


NEVER_RIGHT = """
import dataclasses

from relayrl.rewards.dispatch import register_grader
from relayrl.tasks.arithmetic import ArithmeticTask
from relayrl.tasks.registry import register_task


@register_grader("never_right")
def never_right(problem, completion):
    return 0.0, {"why": "this grader calls every answer wrong"}


@register_task
@dataclasses.dataclass
class NeverRightTask(ArithmeticTask):
    name: str = "never_right"

    def _sample(self, rng, problem_id):
        key, problem = super()._sample(rng, problem_id)
        return key, dataclasses.replace(problem, grader="never_right")
"""


def test_a_grader_that_calls_a_good_answer_wrong(tmp_path, monkeypatch):
    monkeypatch.delenv(PLUGINS_ENV, raising=False)  # restored after the test
    plugin = tmp_path / "never_right_plugin.py"
    plugin.write_text(NEVER_RIGHT)
    code, lines = check(
        "check", ASYNC, "task.name=never_right", "--plugin", str(plugin), f"output_dir={tmp_path}"
    )
    assert code == 1
    line = line_of(lines, "grader")
    assert line.startswith("error: grader: problem never_right-train-0 (grader never_right): ")
    assert "the known-good answer" in line and "scored 0" in line, line
    assert line_of(lines, "server").startswith("skip server:")


def test_a_run_directory_that_cannot_be_written(tmp_path):
    blocker = tmp_path / "a_file"
    blocker.write_text("not a directory\n")
    code, lines = check("check", ASYNC, f"output_dir={blocker}")
    assert code == 1
    line = line_of(lines, "run_dir")
    assert line.startswith(f"error: run_dir: cannot write in {blocker}"), line
    assert "set output_dir" in line


def test_a_run_directory_others_can_write(tmp_path):
    run_dir = tmp_path / "async"
    run_dir.mkdir()
    (run_dir / "metrics.jsonl").write_text("{}\n")
    run_dir.chmod(0o777)
    before = sorted(p.name for p in run_dir.iterdir())
    code, lines = check("check", ASYNC, f"output_dir={tmp_path}")
    assert code == 1
    line = line_of(lines, "run_dir")
    assert "writable by other users (mode 777)" in line and "chmod go-w" in line, line
    assert sorted(p.name for p in run_dir.iterdir()) == before  # nothing touched


def test_a_check_past_its_deadline_is_an_error_and_the_rest_run():
    def hang(_):
        time.sleep(5)

    checks = [
        Check("slow", hang, deadline_s=0.2),
        Check("after", lambda _: "fine"),
        Check("needs_slow", lambda _: "no", ("slow",)),
    ]
    out = io.StringIO()
    report = run_checks(checks, object(), out)
    assert not report.ok
    assert out.getvalue().splitlines() == [
        "error: slow: did not finish within its deadline of 0 s — see --debug",
        "ok   after: fine",
        "skip needs_slow: not run: slow did not pass",
    ]


def test_the_step_estimate_is_linear_through_the_two_measured_points():
    """One group 2 s, four at once 3.5 s: 0.5 s per further group, so 16 groups 9.5 s (not
    16 × 2 s); no slower than one group even when the batch measured faster."""
    from relayrl.train.preflight.live import generation_estimate

    assert generation_estimate(2.0, 4, 3.5, 16) == pytest.approx(9.5)
    assert generation_estimate(2.0, 4, 3.5, 1) == 2.0
    assert generation_estimate(2.0, 4, 1.5, 16) == 2.0
    assert generation_estimate(2.0, 1, 0.0, 3) == 6.0  # nothing measured at once: serial


def test_the_server_estimate_holds_a_whole_weight_load():
    """A server reads a publication whole before copying it in: the trainer's trainable
    tensors at their size (a tied embedding once), so a 3 × 4 fp32 matrix tied to the head
    and a bf16 vector of 5 are 12 × 4 + 5 × 2 = 58 bytes; a frozen tensor is not published."""
    import torch

    from relayrl.train.preflight.context import CheckContext
    from relayrl.train.preflight.live import _weight_load_bytes

    class Tied(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.embed = torch.nn.Embedding(3, 4)
            self.head = torch.nn.Linear(4, 3, bias=False)
            self.head.weight = self.embed.weight
            self.norm = torch.nn.Parameter(torch.ones(5, dtype=torch.bfloat16))
            self.frozen = torch.nn.Parameter(torch.ones(100), requires_grad=False)

    ctx = CheckContext(load=lambda argv: None)  # type: ignore[arg-type,return-value]
    ctx.model = Tied()
    assert _weight_load_bytes(ctx) == 58


@pytest.mark.parametrize(
    ("overrides", "expected"),
    [
        ([], 4 * 7 * 4),  # the canary's deep copy: every parameter, frozen ones too
        (["train.publish_canary_every=0"], 0),
        (["rollout.dtype=bfloat16"], 0),  # servers in another dtype: no canary
    ],
)
def test_the_trainer_estimate_holds_the_canarys_copy_of_the_model(overrides, expected):
    import torch

    from relayrl.config.loader import load_config
    from relayrl.train.preflight.context import CheckContext
    from relayrl.train.preflight.live import _canary_bytes

    model = torch.nn.Linear(7, 4, bias=False)
    model.weight.requires_grad_(False)
    config = load_config(None, ["train.publish_canary_every=10", *overrides])
    ctx = CheckContext(load=lambda argv: config, config=config)
    ctx.model = model
    assert _canary_bytes(ctx) == expected


@pytest.mark.parametrize(
    ("overrides", "trainer", "server"),
    [
        (["rollout.dtype=float32", "train.mixed_precision=none"], 0, 0),
        (["rollout.dtype=bfloat16", "train.mixed_precision=none"], 0, 128),
        (["rollout.dtype=float32", "train.mixed_precision=bf16"], 128, 0),
        (["model.dtype=bfloat16", "train.mixed_precision=none"], 128, 128),
    ],
)
def test_bf16_processes_on_a_cpu_hold_room_for_their_capped_kernel_caches(
    overrides, trainer, server
):
    from relayrl.config.loader import load_config
    from relayrl.heap import KERNEL_CACHE_ENTRIES
    from relayrl.train.preflight.live import kernel_cache_bytes

    assert KERNEL_CACHE_ENTRIES == 128  # the allowance is 1 MiB per entry
    config = load_config(None, ["model.device=cpu", *overrides])
    assert kernel_cache_bytes(config, trainer=True) == trainer * 2**20
    assert kernel_cache_bytes(config, trainer=False) == server * 2**20


@pytest.mark.parametrize(
    ("overrides", "prompt", "shared", "expected"),
    [
        # 8 prompts × 8 samples of 100 + 40 tokens: the budget binds either way
        (["optim.micro_batch_tokens=2048"], 100, True, 2048),
        (["optim.micro_batch_tokens=2048"], 100, False, 2048),
        # a prompt and its 8 completions (100 + 8 × 40 = 420) cannot be split under 256
        (["optim.micro_batch_tokens=256"], 100, True, 420),
        # the whole batch, 1 prompt × 2 samples of 5 + 10 tokens, is less than the budget
        (
            ["rollout.prompts_per_step=1", "rollout.n_samples=2", "rollout.max_new_tokens=10"],
            5,
            False,
            30,
        ),
    ],
)
def test_the_largest_micro_batch_a_step_can_pack(overrides, prompt, shared, expected):
    from relayrl.config.loader import load_config
    from relayrl.train.preflight.live import largest_micro_batch

    base = ["rollout.prompts_per_step=8", "rollout.n_samples=8", "rollout.max_new_tokens=40"]
    config = load_config(None, [*base, *overrides])
    assert largest_micro_batch(config, prompt, shared) == expected


def test_the_trainer_estimate_scales_the_measured_activations_to_the_largest_micro_batch():
    """Held 40 GiB between steps, 1 GiB of activations for a micro-batch of 512 positions,
    the largest of the run 2048: 40 + 1 × 4 × 1.5 (the allowance for a run's fragmented heap)
    = 46 GiB (far above this process's own peak)."""
    from relayrl.config.loader import load_config
    from relayrl.train.preflight.context import CheckContext
    from relayrl.train.preflight.live import ACTIVATION_ALLOWANCE, _trainer_peak

    gib = 2**30
    config = load_config(
        None,
        [
            "optim.micro_batch_tokens=2048",
            "rollout.prompts_per_step=8",
            "rollout.n_samples=8",
            "rollout.max_new_tokens=40",
            "train.publish_canary_every=0",
        ],
    )
    ctx = CheckContext(load=lambda argv: config, config=config)
    ctx.prompt_ids = list(range(100))
    ctx.measures.update(
        trainer_held=40 * gib,
        step_activations=gib,
        step_positions=512,
        trainer_peak_before_step=0,
    )
    assert ACTIVATION_ALLOWANCE == 1.5
    assert _trainer_peak(ctx) == 46 * gib
    ctx.measures["step_positions"] = 4096  # a measured micro-batch above the largest: no less
    assert _trainer_peak(ctx) == int(41.5 * gib)
