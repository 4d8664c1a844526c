"""Preflight checks of a run's inputs: plugins, config, dataset, grader, model, template.

Owns: :func:`check_plugins`, :func:`check_config`, :func:`check_dataset` (the train
problems parse: ``rollout.dataset``'s rows, or the task's generated problems; the first and
a random one are kept), :func:`check_grader` (each kept problem's known-good answer scores
1 and a known-bad one 0, graded in a :class:`~relayrl.rewards.pool.GradingPool` as in the
run: code in the sandbox), :func:`check_model` (``model.path``'s tokenizer and weights, or
the preset the run would build and warm-start) and :func:`check_template` (the tokenizer
and chat template render the first prompt, with ``model.system_prompt``). And
:func:`known_good` / :func:`known_bad`: the answers the grader check uses.

Imports: config, errors, models, plugins, rewards, tasks, relayrl.train.run.setup.
"""

from __future__ import annotations

import random
from pathlib import Path
from typing import Any

from relayrl.errors import RelayError
from relayrl.tasks.base import Problem
from relayrl.train.preflight.context import CheckContext
from relayrl.train.preflight.runner import CheckFailed

SYNTHETIC_SAMPLE = 8  # generated train problems looked at when there is no dataset
BUILD_CORPUS = 200  # texts the tokenizer of a preset is trained on (the run uses more)


def check_plugins(ctx: CheckContext) -> str:
    """Import ``--plugin``'s modules and the config file's ``plugins:``."""
    from relayrl.plugins import load_plugins

    specs = list(ctx.plugins) + _file_plugins(ctx.config_path)
    loaded = load_plugins(specs)
    ctx.plugins = loaded[: len(ctx.plugins)]
    if not loaded:
        return "none configured"
    return f"{len(loaded)} imported: {', '.join(loaded)}"


def _file_plugins(path: str | None) -> list[str]:
    """The ``plugins:`` of config file ``path`` ([] when it cannot be read: the config
    check says why)."""
    if path is None:
        return []
    from relayrl.config.loader import read_yaml

    try:
        data, _ = read_yaml(path)
    except RelayError:
        return []
    plugins = data.get("plugins") if isinstance(data, dict) else None
    return [str(p) for p in plugins] if isinstance(plugins, list) else []


def check_config(ctx: CheckContext) -> str:
    """Read, override and validate the config."""
    config = ctx.config = ctx.load(ctx.plugins)
    model = config.model.path or f"preset {config.model.preset} (SFT warm start first)"
    data = config.rollout.dataset or f"task {config.task.name}"
    return (
        f"{data}, model {model}, rollout.engine={config.rollout.engine}, "
        f"launcher={config.launcher}, eta={config.rollout.eta}, loss={config.algo.loss}"
    )


def check_dataset(ctx: CheckContext) -> str:
    """The train problems parse; keep the first and a random one."""
    from relayrl.train.run.setup import train_problems

    config = _config(ctx)
    task = _task(ctx)
    if config.rollout.dataset:
        problems = train_problems(config, None)
        source = f"rollout.dataset {config.rollout.dataset}"
    else:
        problems = task.problems("train", SYNTHETIC_SAMPLE, config.task.seed)
        source = f"task {config.task.name} ({SYNTHETIC_SAMPLE} generated)"
    if not problems:
        raise CheckFailed(f"{source} has no problems", "point rollout.dataset at a file with rows")
    index = random.Random(config.seed).randrange(len(problems))
    ctx.problems = [problems[0], problems[index]]
    ctx.problem_count = len(problems)
    graders = sorted({p.grader for p in ctx.problems})
    return (
        f"{source}: {len(problems)} problems parse; first ({problems[0].id}) and random "
        f"({problems[index].id}) rows kept, grader {', '.join(graders)}"
    )


def _task(ctx: CheckContext) -> Any:
    """The run's task (``task.name`` with ``task.params``), made once."""
    from relayrl.tasks.registry import make_task

    if ctx.task is None:
        config = _config(ctx)
        ctx.task = make_task(config.task.name, config.task.params)
    return ctx.task


def uses_code(ctx: CheckContext) -> bool:
    return any(p.grader == "code" for p in ctx.problems)


def known_good(problem: Problem, task: Any) -> str:
    """A completion the problem's grader must score 1: the task's own worked demonstration
    for generated problems, else the reference answer in the form its grader reads."""
    if problem.meta.get("dataset") is None and task is not None:
        return task.demonstration(problem, random.Random(0), wrong=False)
    if problem.grader == "code":
        return problem.answer
    if problem.grader == "reasoning_gym":
        return f"<answer>{problem.answer}</answer>"
    if problem.grader == "math" and "math" in problem.meta:
        return f"The answer is \\boxed{{{problem.answer}}}.\n#### {problem.answer}"
    return f"#### {problem.answer}"


def wrong_answer(answer: str) -> str:
    """An answer that differs from ``answer``: the number plus 1, else a marker text."""
    try:
        return str(int(float(answer.replace(",", ""))) + 1)
    except ValueError:
        return "relayrl-check-wrong-answer"


def known_bad(problem: Problem) -> str:
    """A completion the problem's grader must score 0."""
    if problem.grader == "code":
        return "    raise NotImplementedError\n"
    bad = wrong_answer(problem.answer)
    if problem.grader == "reasoning_gym":
        return f"<answer>{bad}</answer>"
    return f"The answer is \\boxed{{{bad}}}.\n#### {bad}"


def check_grader(ctx: CheckContext) -> str:
    """Grade each kept problem's known-good and known-bad answer in a grading pool."""
    from relayrl.rewards.pool import GradingPool
    from relayrl.rewards.sandbox import sandbox_settings

    config = _config(ctx)
    ctx.settings.enter_context(sandbox_settings(config.sandbox.allow_unisolated))
    ctx.pool = GradingPool(1, config.rollout.reward_timeout_s)
    items = [(p, text) for p in ctx.problems for text in (known_good(p, ctx.task), known_bad(p))]
    results = ctx.pool.grade_batch(items)
    for (problem, text), result, good in zip(items, results, [True, False] * 2, strict=True):
        if (result.reward > 0) != good:
            raise _wrong_grade(problem, text, result, good)
    names = ", ".join(sorted({p.grader for p in ctx.problems}))
    return f"{names}: 2 known-good answers score 1, 2 known-bad score 0"


def _wrong_grade(problem: Problem, text: str, result: Any, good: bool) -> CheckFailed:
    kind = "known-good" if good else "known-bad"
    shown = text.strip().replace("\n", " ")[-80:]
    detail = result.detail or result.info or result.status
    return CheckFailed(
        f"problem {problem.id} (grader {problem.grader}): the {kind} answer {shown!r} scored "
        f"{result.reward:g} ({result.status}: {str(detail)[:160]})",
        "check that the answer field holds the reference answer (rollout.dataset's fields) "
        "and that the grader reads the format the prompt asks for",
    )


def check_model(ctx: CheckContext) -> str:
    """Load ``model.path``'s tokenizer and policy, or build the preset the run starts from."""
    from relayrl.models.loading import load_model, load_tokenizer

    config = _config(ctx)
    if config.model.path:
        ctx.model_dir = _model_dir(config.model.path)
        what = str(ctx.model_dir)
    else:
        ctx.model_dir = _build_preset(ctx)
        what = f"no model.path: preset {config.model.preset} built (the run SFT-trains it first)"
    ctx.tokenizer = load_tokenizer(ctx.model_dir)
    ctx.model = load_model(ctx.model_dir, config.model.device, config.model.dtype)
    params = sum(p.numel() for p in ctx.model.parameters())
    arch = type(ctx.model).__name__
    return f"{what}: {arch}, {params / 1e6:.2f}M parameters, {config.model.dtype} on {config.model.device}"


def _model_dir(path: str) -> Path:
    from relayrl.models.loading import check_model_dir

    try:
        return check_model_dir(path)
    except RelayError as exc:
        raise CheckFailed(
            str(exc), "set model.path to a Hugging Face model directory, a .gguf or pkg:NAME"
        ) from exc


def _build_preset(ctx: CheckContext) -> Path:
    from relayrl.models.build import create_model_dir

    config = _config(ctx)
    out = ctx.tmp / "model"
    create_model_dir(
        out,
        _task(ctx),
        config.model.preset,
        seed=config.seed,
        max_position_embeddings=config.model.max_context,
        vocab_size=config.model.vocab_size,
        corpus_size=BUILD_CORPUS,
    )
    return out


def check_template(ctx: CheckContext) -> str:
    """Render the first problem's prompt as the run does; it must leave room to generate."""
    from relayrl.models.loading import encode_prompt

    config = _config(ctx)
    system = config.model.system_prompt
    ctx.prompt_ids = encode_prompt(ctx.tokenizer, ctx.problems[0].prompt, system)
    room = config.model.max_context - len(ctx.prompt_ids)
    if room <= 0:
        raise CheckFailed(
            f"the first prompt is {len(ctx.prompt_ids)} tokens, model.max_context is "
            f"{config.model.max_context}",
            "raise model.max_context or shorten the prompt template",
        )
    kind = "chat template" if getattr(ctx.tokenizer, "chat_template", None) else "plain template"
    turn = " with the system turn" if system else ""
    return (
        f"{kind}{turn}: the first prompt is {len(ctx.prompt_ids)} tokens ({room} left to generate)"
    )


def _config(ctx: CheckContext):
    assert ctx.config is not None, "the config check runs first"
    return ctx.config
