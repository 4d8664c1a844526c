"""The teacher of on-policy distillation as one more rollout server of the run.

Owns: :func:`teacher_launcher` (``distill.teacher`` a model directory: a built-in engine
server over it, started by the run's :class:`~relayrl.launch.servers.ServerLauncher` code,
its log in ``<run>/teacher/server-0.log``) and :func:`with_teacher_url` (the run config
pointing the rollout side at the started server). A teacher given as a URL is used as is,
once it has proved that it holds the key (``relayrl.train.run.rollout.teacher_scorer``).
The teacher's weights never change, so it takes no weight updates and no supervision beyond
its start-up check.

Imports: relayrl.config (schema), relayrl.launch.servers, relayrl.runkey.
"""

from __future__ import annotations

from pathlib import Path

from relayrl.config.schema import RunConfig
from relayrl.launch.servers import ServerLauncher, ServerSpec
from relayrl.runkey import new_key


def teacher_launcher(config: RunConfig, run_dir: Path) -> ServerLauncher | None:
    """A launcher of the teacher's server when ``distill.teacher`` is a model directory
    (not started); None when distillation is off or the teacher is a URL."""
    teacher = config.distill.teacher
    if teacher is None or teacher.startswith(("http://", "https://")):
        return None
    spec = ServerSpec(
        model_dir=str(Path(teacher).resolve()),
        threads=config.rollout.server_threads,
        max_running_requests=config.rollout.max_running_requests,
        max_seq_len=config.model.max_context,
        device=config.model.device,
        dtype=config.model.dtype,
        # a key of the teacher's own, no rollout server's: the server holds the key derived
        # from it (ServerLauncher.key_of), as every launched server does
        api_key=new_key(),
    )
    return ServerLauncher(
        spec,
        1,
        config.rollout.server_mode,
        log_dir=run_dir / "teacher",
        startup_timeout_s=config.rollout.startup_timeout_s,
    )


def with_teacher_url(config: RunConfig, launcher: ServerLauncher) -> RunConfig:
    """``config`` with ``distill.teacher`` set to the started teacher server's URL (and
    ``distill.api_key`` to the key that server holds)."""
    update = {"teacher": launcher.urls[0], "api_key": launcher.key_of(0)}
    distill = config.distill.model_copy(update=update)
    return config.model_copy(update={"distill": distill})
