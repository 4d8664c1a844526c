"""Preflight checks of the machine a run needs: backend environment, sandbox, run directory.

Owns: :func:`check_environment` (``rollout.engine=vllm``: the vLLM environment's Python
exists and imports vllm; the launcher's own check, ``launcher=ray``: ray imports;
``train.loggers``' packages; ``train.world_size`` on this machine), :func:`check_sandbox`
(the sandbox backend runs a known-good and a known-bad program, when the run grades code)
and :func:`check_run_dir` (the run directory can be created or written and is private, its
run key is 0600 and ours, the fixed ports are free; nothing in an existing run directory is
touched).

Imports: config, errors, launch (backends, launchers, vllm), rewards (sandbox), runkey,
relayrl.train (loggers, distributed).
"""

from __future__ import annotations

import os
import socket
import stat
import subprocess
import tempfile
from pathlib import Path

from relayrl.train.preflight.context import CheckContext
from relayrl.train.preflight.inputs import uses_code
from relayrl.train.preflight.runner import CheckFailed

VLLM_IMPORT_TIMEOUT_S = 150.0


def check_environment(ctx: CheckContext) -> str:
    """The backend's, the launcher's, the loggers' and the trainer ranks' environment."""
    from relayrl.launch.launchers import make_launcher
    from relayrl.train.distributed import check_trainer_ranks
    from relayrl.train.loggers import check_loggers

    config = ctx.config
    assert config is not None
    parts = [_backend_environment(ctx)]
    launcher = make_launcher(config).check_environment()
    if launcher is not None:
        parts.append(launcher)
    loggers = check_loggers(config)
    parts.append(f"loggers: {', '.join(loggers) or 'metrics.jsonl only'}")
    check_trainer_ranks(config)
    parts.append(f"train.world_size={config.train.world_size}")
    return "; ".join(parts)


def _backend_environment(ctx: CheckContext) -> str:
    from relayrl.launch.backends import make_backend

    config = ctx.config
    assert config is not None
    engine = config.rollout.engine
    if config.rollout.server_urls:
        return f"rollout.engine={engine} on {len(config.rollout.server_urls)} external server(s)"
    if engine != "vllm":
        make_backend(config, "").server_spec()  # what it checks before launching
        return f"rollout.engine={engine}"
    from relayrl.launch.vllm import find_vllm_python

    python = find_vllm_python(config.rollout.vllm.python)
    version = _import_vllm(python)
    return f"rollout.engine=vllm: {python} imports vllm {version}"


def _import_vllm(python: str) -> str:
    """``import vllm`` in ``python``; its version, or CheckFailed with the import's error."""
    code = "import vllm; print(vllm.__version__)"
    fix = "build .venv-vllm with `make vllm` or point rollout.vllm.python at a Python with vLLM"
    try:
        out = subprocess.run(
            [python, "-c", code], capture_output=True, text=True, timeout=VLLM_IMPORT_TIMEOUT_S
        )
    except (OSError, subprocess.TimeoutExpired) as exc:
        raise CheckFailed(f"{python} -c 'import vllm' failed: {exc}", fix) from exc
    if out.returncode != 0:
        lines = [ln for ln in out.stderr.splitlines() if ln.strip()]
        raise CheckFailed(
            f"{python} cannot import vllm: {lines[-1] if lines else out.returncode}", fix
        )
    return out.stdout.strip().splitlines()[-1] if out.stdout.strip() else "?"


def check_sandbox(ctx: CheckContext) -> str:
    """When the run grades code: the sandbox's probe and a graded known-good/bad pair."""
    if not uses_code(ctx):
        return "not needed (no code grading)"
    from relayrl.rewards.code import probe_code_grading
    from relayrl.rewards.sandbox import sandbox_settings

    assert ctx.config is not None
    ctx.settings.enter_context(sandbox_settings(ctx.config.sandbox.allow_unisolated))
    backend = probe_code_grading()
    return f"backend {backend}: a known-good program passes, a known-bad one fails, isolated"


def check_run_dir(ctx: CheckContext) -> str:
    """The run directory, its run key and the fixed ports; see the module docstring."""
    config = ctx.config
    assert config is not None
    run_dir = Path(config.output_dir) / config.name
    parts = [_run_dir_state(run_dir), _run_key_state(run_dir)]
    parts.extend(_port_states(ctx))
    return "; ".join(parts)


def _run_dir_state(run_dir: Path) -> str:
    fix = "set output_dir (or name) to a directory you own and can write"
    if run_dir.exists():
        if not run_dir.is_dir():
            raise CheckFailed(f"run directory {run_dir} exists and is not a directory", fix)
        info = run_dir.stat()
        if info.st_uid != os.getuid():
            raise CheckFailed(f"run directory {run_dir} belongs to uid {info.st_uid}", fix)
        if info.st_mode & (stat.S_IWGRP | stat.S_IWOTH):
            raise CheckFailed(
                f"run directory {run_dir} is writable by other users "
                f"(mode {stat.S_IMODE(info.st_mode):o})",
                f"`chmod go-w {run_dir}` (docs/security.md)",
            )
        _probe_writable(run_dir, fix)
        return f"run directory {run_dir} exists ({sum(1 for _ in run_dir.iterdir())} entries), ours and writable"
    parent = _existing_parent(run_dir)
    _probe_writable(parent, fix)
    return f"run directory {run_dir} can be created (in {parent})"


def _existing_parent(path: Path) -> Path:
    parent = path.parent
    while not parent.exists() and parent != parent.parent:
        parent = parent.parent
    return parent


def _probe_writable(directory: Path, fix: str) -> None:
    """Create and remove a fresh file in ``directory`` (no existing file is touched)."""
    try:
        fd, name = tempfile.mkstemp(prefix=".relayrl-check-", dir=directory)
        os.close(fd)
        os.unlink(name)
    except OSError as exc:
        raise CheckFailed(f"cannot write in {directory}: {exc.strerror or exc}", fix) from exc


def _run_key_state(run_dir: Path) -> str:
    from relayrl.runkey import RUN_KEY_FILE, key_from_env, read_key_file

    key_from_env()  # $RELAYRL_API_KEY_FILE: ours and 0600
    path = run_dir / RUN_KEY_FILE
    if not path.exists():
        return "run key created 0600 at start"
    read_key_file(path, "run key")
    return "run key 0600 and ours"


def port_taken(port: int, host: str = "127.0.0.1") -> bool:
    """Whether ``port`` on ``host`` cannot be bound now."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        try:
            s.bind((host, port))
        except OSError:
            return True
    return False


def _port_states(ctx: CheckContext) -> list[str]:
    config = ctx.config
    assert config is not None
    fixed = []
    if (
        config.rollout.engine == "vllm"
        and config.rollout.vllm.port
        and not config.rollout.server_urls
    ):
        start = config.rollout.vllm.port
        fixed += [(f"rollout.vllm.port+{i}", start + i) for i in range(config.rollout.num_servers)]
    if config.train.world_size > 1 and config.train.master_port:
        fixed.append(("train.master_port", config.train.master_port))
    for key, port in fixed:
        if port_taken(port):
            raise CheckFailed(
                f"{key}: port {port} on 127.0.0.1 is in use", f"free it or choose another {key}"
            )
    if not fixed:
        return ["ports: free loopback ports chosen at start"]
    return [f"ports {', '.join(str(p) for _, p in fixed)} free"]
