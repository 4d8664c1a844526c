"""``relayrl eval --model DIR --data NAME_OR_PATH --n K --temperature T``: generate with the
built-in engine in this process, or with rollout servers already running
(``--server-url URL [--engine builtin|vllm]``: ``relayrl serve``, a vLLM server, servers of
someone else), grade (math-verify / sandboxed code in a process pool), report pass@1,
unbiased pass@k and maj@k, and write a per-problem JSONL.

A dataset's rows become problems as training reads them: ``--prompt-field``,
``--answer-field``, ``--id-field``, ``--template`` and ``--grader`` are ``rollout.dataset``'s
keys as flags (``relayrl.cli.common.data_source``), read by ``relayrl.eval.sets.load_source``.

With ``--server-url`` the rollout backend of ``--engine`` (``relayrl.launch.backends``)
gives the client class and the read-only protocol check; ``relayrl.eval.remote`` turns the
client into the engine :func:`relayrl.eval.evaluate.evaluate` runs on. ``--model`` is still
read: its tokenizer encodes the prompts and decodes the completions, so it must be the
served model's.
"""

from __future__ import annotations

import argparse
from collections.abc import Iterator
from contextlib import contextmanager

from relayrl.cli.common import DATA_SOURCE_OPTIONS, add_data_source_arguments, data_source
from relayrl.errors import RelayError
from relayrl.tasks.datasets import FLAGS, setting_name

HELP = "evaluate a model on a benchmark or synthetic task: pass@1, pass@k, maj@k"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--model", default=None, help="Hugging Face model directory (default: --config's)"
    )
    parser.add_argument(
        "--data",
        required=True,
        help="benchmark name (gsm8k, math500, aime24, aime25, humaneval, "
        "math_train), a synthetic task (arithmetic, countdown: its test "
        "split), a .jsonl/.parquet file, a directory datasets' save_to_disk wrote (its test "
        "split) or hub:<name>",
    )
    parser.add_argument(
        "--task-params",
        default=None,
        metavar="YAML",
        help="parameters of a synthetic --data task, as task.params takes them, e.g. "
        "'{max_steps: 3, tail: 0.5}' (default: --config's task.params when --data is its "
        "task)",
    )
    parser.add_argument(
        "--task-seed",
        type=int,
        default=None,
        help="seed of a synthetic task's problems (default: --config's task.seed when --data "
        "is its task, else 0)",
    )
    parser.add_argument(
        "--system-prompt",
        default=None,
        metavar="TEXT",
        help="a system message before every prompt, as model.system_prompt (default: --config's)",
    )
    parser.add_argument("--n", type=int, default=1, help="samples per problem (K)")
    parser.add_argument("--temperature", type=float, default=1.0)
    parser.add_argument("--max-new-tokens", type=int, default=512)
    parser.add_argument(
        "--max-context",
        type=int,
        default=None,
        metavar="N",
        help="longest prompt + completion in tokens, as model.max_context: a longer prompt is "
        "not generated (too_long_for_context), a completion stops at it (default: --config's "
        "model.max_context, else the model's or the servers' context)",
    )
    parser.add_argument("--limit", type=int, default=None, help="first N problems only")
    parser.add_argument("--out", default=None, help="per-problem JSONL (default: print path)")
    parser.add_argument("--data-root", default=None, help="folder of the benchmark files")
    parser.add_argument("--workers", type=int, default=2, help="grading processes")
    parser.add_argument("--timeout", type=float, default=30.0, help="seconds per grade")
    parser.add_argument("--seed", type=int, default=0)
    add_in_process_engine_arguments(parser)
    parser.add_argument(
        "--server-url",
        action="append",
        default=None,
        metavar="URL",
        help="generate on this running rollout server instead of in process (repeat for "
        "several; --threads, --device and --max-running-requests then do not apply)",
    )
    parser.add_argument(
        "--engine",
        default=None,
        help="protocol of --server-url: builtin (`relayrl serve`, the default) or vllm "
        "(default with --config: its rollout.engine)",
    )
    parser.add_argument(
        "--config",
        default=None,
        help="run config: its model.path, and its rollout servers (rollout.server_urls, or "
        "launched through rollout.engine when that is not builtin)",
    )
    parser.add_argument(
        "--api-key",
        default=None,
        help="bearer token of --server-url (default: $RELAYRL_API_KEY or the contents of "
        "$RELAYRL_API_KEY_FILE; prefer those: a command line is visible to other users)",
    )
    add_data_source_arguments(parser)


def add_in_process_engine_arguments(parser: argparse.ArgumentParser) -> None:
    """The options of the engine that generates in this process (not with --server-url)."""
    parser.add_argument("--threads", type=int, default=2, help="torch threads for generation")
    parser.add_argument("--device", default="cpu")
    parser.add_argument(
        "--dtype",
        default=None,
        choices=("float32", "bfloat16", "float16"),
        help="weights of the in-process engine (default: --config's rollout.dtype, else float32)",
    )
    parser.add_argument("--max-running-requests", type=int, default=64)


def load_eval_problems(args: argparse.Namespace):
    """``--data``'s test problems: a synthetic task's, else the dataset's read with the
    columns, template and grader flags by the training path's reader (errors name flags)."""
    from relayrl.eval.sets import load_source
    from relayrl.tasks.registry import TASKS, make_task

    if args.data in TASKS:
        _no_row_options(args)
        task = make_task(args.data, _task_params(args.task_params))
        seed = 0 if args.task_seed is None else args.task_seed
        return task.problems("test", args.limit or 500, seed=seed)
    if args.task_params is not None:
        raise RelayError(
            f"--task-params: --data {args.data!r} is not a synthetic task "
            f"(one of {sorted(TASKS)}); a dataset takes no task parameters"
        )
    source = data_source(args)
    return load_source(source, FLAGS, "test", limit=args.limit, data_root=args.data_root)


def _task_defaults(args: argparse.Namespace, config) -> None:
    """``--data`` naming the ``--config``'s own task: its ``task.params`` and ``task.seed``
    unless given, so the held-out problems are the ones the run evaluates on."""
    import json

    if config is None or args.data != config.task.name:
        return
    if args.task_params is None and config.task.params:
        args.task_params = json.dumps(config.task.params)
    if args.task_seed is None:
        args.task_seed = config.task.seed


def _no_row_options(args: argparse.Namespace) -> None:
    """A synthetic task has no rows: a column, template or grader flag is an error."""
    given = [option for option in DATA_SOURCE_OPTIONS if getattr(args, option) is not None]
    if given:
        raise RelayError(
            f"{setting_name(FLAGS, given[0])}: --data {args.data!r} is a synthetic task, "
            "whose problems have no columns; the column, template and grader flags are for "
            "a dataset"
        )


def _task_params(text: str | None) -> dict:
    """``--task-params`` as a mapping (YAML or JSON)."""
    import yaml

    if text is None:
        return {}
    try:
        params = yaml.safe_load(text)
    except yaml.YAMLError as exc:
        raise RelayError(f"--task-params: not valid YAML/JSON: {exc}") from None
    if not isinstance(params, dict):
        raise RelayError(f"--task-params: expected a mapping like '{{max_steps: 3}}', got {text!r}")
    return params


def _system_prompt(args: argparse.Namespace, config) -> str | None:
    """``--system-prompt``, else the ``--config``'s ``model.system_prompt``."""
    if args.system_prompt is not None:
        return args.system_prompt or None
    return config.model.system_prompt if config is not None else None


def _max_context(args: argparse.Namespace, config) -> int | None:
    """``--max-context``, else the ``--config``'s ``model.max_context`` (None: neither)."""
    if args.max_context is not None:
        if args.max_context < 2:
            raise RelayError(f"--max-context must be >= 2, got {args.max_context}")
        return args.max_context
    return config.model.max_context if config is not None else None


def _dtype(args: argparse.Namespace, config) -> str:
    """``--dtype``, else what the ``--config``'s servers generate in (``rollout.dtype``, else
    ``model.dtype``)."""
    if args.dtype is not None:
        return args.dtype
    return config.served_dtype if config is not None else "float32"


def cap_context(engine, max_context: int | None) -> None:
    """Bound ``engine``'s context (prompt + completion) by ``max_context``: what
    :func:`relayrl.eval.evaluate.evaluate` reads to skip prompts and cap completions, on the
    in-process engine (already built with it) and on servers of a longer context alike."""
    if max_context is not None and max_context < engine.max_seq_len:
        engine.max_seq_len = max_context


def _run_config(args: argparse.Namespace):
    """``--config`` loaded (None without it); its ``model.path`` is the default ``--model``."""
    from relayrl.config.loader import load_config
    from relayrl.errors import RelayError
    from relayrl.models.gguf import resolve_model_path

    config = load_config(args.config) if args.config else None
    if args.model is None:
        if config is None or not config.model.path:
            raise RelayError("--model: required (or a --config whose model.path is set)")
        args.model = config.model.path
    args.model = resolve_model_path(args.model, key="--model")
    return config


def _backend(args: argparse.Namespace, config):
    """The rollout backend of ``--engine``, else of the config's ``rollout.engine``."""
    from relayrl.config.loader import load_config
    from relayrl.errors import RelayError
    from relayrl.launch.backends import make_backend
    from relayrl.registry import ROLLOUT_BACKENDS

    if config is None or args.engine is not None:
        name = args.engine or "builtin"
        try:
            ROLLOUT_BACKENDS.check(name)
        except ValueError as exc:
            raise RelayError(f"--engine: {exc}") from None
        config = load_config(args.config, [f"rollout.engine={name}"])
    backend = make_backend(config, args.model)
    if args.api_key:  # the key of servers someone else started; launched ones get their own
        backend.api_key = args.api_key
    return backend


def _remote(backend, urls: list[str], origin: str):
    """A :class:`RemoteEngine` over ``urls`` speaking ``backend``'s protocol; an unreachable
    server is an error naming ``origin`` (where the URLs came from)."""
    from relayrl.engine.client import RolloutServerError
    from relayrl.errors import RelayError
    from relayrl.eval.remote import RemoteEngine

    try:
        return RemoteEngine(
            # a request's time includes its wait in the server's queue: an hour, as training
            lambda: backend.client(list(urls), timeout=3600.0),
            check=backend.check_protocols,
        )
    except RolloutServerError as exc:
        raise RelayError(f"{origin}: {exc}") from exc


@contextmanager
def _generation_engine(args: argparse.Namespace, config) -> Iterator:
    """What generates: ``--server-url``; else the config's servers (``rollout.server_urls``,
    or launched through its backend when ``rollout.engine`` is not the built-in one, and
    stopped afterwards); else the built-in engine in this process."""
    from relayrl.errors import RelayError

    if args.server_url:
        bad = [u for u in args.server_url if not u.startswith(("http://", "https://"))]
        if bad:
            raise RelayError(f"--server-url {bad[0]!r}: expected an http:// or https:// URL")
        backend = _backend(args, config)
        # each server proves that it holds the key before it is sent (docs/security.md)
        backend.external_servers(args.server_url, "--server-url", wait=False).start()
        with _remote(backend, args.server_url, "--server-url") as engine:
            yield engine
        return
    if config is not None and (config.rollout.server_urls or config.rollout.engine != "builtin"):
        backend = _backend(args, config)
        launcher = backend.launcher(None)
        try:
            urls = launcher.start()
            origin = "rollout.server_urls" if config.rollout.server_urls else "launched server"
            with _remote(backend, urls, origin) as engine:
                yield engine
        finally:
            launcher.stop()
        return
    from relayrl.engine.engine import Engine
    from relayrl.engine.types import EngineOptions

    options = EngineOptions(
        device=args.device,
        dtype=_dtype(args, config),
        max_running_requests=args.max_running_requests,
        max_seq_len=args.max_context,
    )
    with Engine.from_pretrained(args.model, options) as engine:
        yield engine


def run(args: argparse.Namespace) -> int:
    import json
    from pathlib import Path

    import torch

    from relayrl.config.schema import EvalConfig
    from relayrl.engine.client import RolloutServerError
    from relayrl.errors import RelayError
    from relayrl.eval.evaluate import WeightsChanged, evaluate, pool_grader
    from relayrl.models.loading import check_model_dir, load_tokenizer
    from relayrl.rewards.pool import GradingPool

    if args.n < 1 or args.temperature < 0 or args.max_new_tokens < 1:
        raise RelayError("--n and --max-new-tokens must be >= 1 and --temperature >= 0")
    config = _run_config(args)
    args.max_context = _max_context(args, config)
    check_model_dir(args.model)
    tokenizer = load_tokenizer(args.model)
    _task_defaults(args, config)
    problems = load_eval_problems(args)
    if not problems:
        raise RelayError(f"dataset {args.data!r} has no problems")
    torch.set_num_threads(args.threads)
    cfg = EvalConfig(
        num_problems=len(problems),
        n_samples=args.n,
        temperature=args.temperature,
        max_new_tokens=args.max_new_tokens,
    )
    with (
        _generation_engine(args, config) as engine,
        GradingPool(
            workers=args.workers,
            timeout_s=args.timeout,
            probe_sandbox=any(p.grader == "code" for p in problems),
        ) as pool,
    ):
        cap_context(engine, args.max_context)
        try:
            report = evaluate(
                engine,
                tokenizer,
                problems,
                cfg,
                seed=args.seed,
                grader=pool_grader(pool),
                progress=True,
                system_prompt=_system_prompt(args, config),
            )
        except (RolloutServerError, WeightsChanged) as exc:  # servers only
            raise RelayError(f"evaluation failed: {exc}") from exc
        grading = pool.stats()
    out = Path(args.out or f"eval-{Path(args.data).stem}.jsonl")
    with open(out, "w") as f:
        for row in report.per_problem:
            f.write(json.dumps(row) + "\n")
    print(f"per-problem results: {out}")
    print(
        f"problems={report.num_problems} samples_per_problem={report.n_samples} "
        f"temperature={report.temperature} weight_version={report.weight_version} "
        f"too_long_for_context={report.too_long} grading={grading}"
    )
    for key, value in report.summary().items():
        if key.startswith(("pass@", "maj@")) and key != "pass@1":
            print(f"{key}={value:.4f}")
    print(f"pass@1={report.pass_at_1:.4f}")
    return 0
