"""Run untrusted programs in a sandbox subprocess.

Two backends (``$RELAYRL_SANDBOX``: ``auto`` (default), ``bwrap`` or ``launcher``):

* ``bwrap`` — Debian's bubblewrap builds the isolation: new network, pid, ipc and uts
  namespaces, a **read-only root**, a size-capped private ``/tmp`` and ``/dev/shm``, and
  the run dies with its parent; inside it the launcher sets the rlimits, no-new-privs and
  the per-run uid, then ``exec``s the command. ``auto`` picks it when ``bwrap`` is installed
  and works here (a one-time probe).
* ``launcher`` — the fallback with no extra package: ``python -I -S _sandbox_launch.py``
  isolates itself (network and mount namespaces, rlimits, no-new-privs, a per-run uid when
  we are root) and ``exec``s the command.

:func:`start_sandbox` creates a throw-away directory, writes the given files there and
starts the backend in a new session. The environment is scrubbed to a fixed minimum, stdout/stderr go to
files capped by RLIMIT_FSIZE, and on exit or timeout everything the run started is killed:
its process group, then every process owned by its uid (``kill(-1)`` as that uid, which
the kernel applies atomically, so a fork bomb cannot outrun it). See docs/graders.md for what
this does and does not protect against.
"""

from __future__ import annotations

import contextlib
import functools
import json
import os
import secrets
import shutil
import signal
import stat
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict, dataclass
from pathlib import Path

LAUNCHER = Path(__file__).with_name("_sandbox_launch.py")
# launcher backend: sandbox uid = BASE_UID + launcher pid (unique among live runs); bwrap
# backend: BASE_UID + PID_SPACE + a random number checked to be unused
BASE_UID = 200_000
PID_SPACE = 1 << 22
BACKENDS = ("bwrap", "launcher")
SAFE_ENV = {"PATH": "/usr/local/bin:/usr/bin:/bin", "LANG": "C.UTF-8", "HOME": "/nonexistent"}


@dataclass(frozen=True)
class SandboxLimits:
    """Per-run limits. ``file_bytes`` caps every file the program writes, stdout included."""

    wall_s: float = 10.0
    cpu_s: int = 10
    memory_mb: int = 1024
    nproc: int = 16
    nofile: int = 64
    file_bytes: int = 1 << 20
    disk_mb: int = 32
    output_bytes: int = 64 << 10


@dataclass(frozen=True)
class SandboxResult:
    """How a sandboxed run ended; stdout/stderr are truncated to ``output_bytes``."""

    returncode: int | None
    timed_out: bool
    stdout: bytes
    stderr: bytes
    wall_s: float


class SandboxProcess:
    """A running sandboxed command; use as a context manager so cleanup always happens."""

    def __init__(
        self, proc: subprocess.Popen, base: Path, limits: SandboxLimits, uid: int | None = None
    ) -> None:
        self.proc = proc
        self.base = base
        self.limits = limits
        if uid is None and os.geteuid() == 0:
            uid = BASE_UID + proc.pid
        self.uid = uid
        self.started = time.monotonic()

    def wait(self, timeout: float | None = None) -> bool:
        """True when the process ended within ``timeout`` seconds."""
        try:
            self.proc.wait(timeout)
            return True
        except subprocess.TimeoutExpired:
            return False

    def read_output(self, name: str) -> bytes:
        path = self.base / name
        with contextlib.suppress(OSError), path.open("rb") as handle:
            return handle.read(self.limits.output_bytes)
        return b""

    def kill(self) -> None:
        """Kill the process group and every process owned by the run's uid."""
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(self.proc.pid, signal.SIGKILL)
        with contextlib.suppress(OSError):
            self.proc.kill()
        self.proc.wait()
        if self.uid is not None:
            kill_uid(self.uid)

    def close(self) -> None:
        self.kill()
        shutil.rmtree(self.base, ignore_errors=True)

    def __enter__(self) -> SandboxProcess:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def _live_processes():
    """(pid, uid, ppid) of every live (non-zombie) process, read from /proc."""
    for entry in os.scandir("/proc"):
        if not entry.name.isdigit():
            continue
        try:
            with open(f"/proc/{entry.name}/status", encoding="ascii", errors="replace") as f:
                fields = dict(line.split(":", 1) for line in f if ":" in line)
        except OSError:
            continue
        state = fields.get("State", "Z").split()
        if state and not state[0].startswith("Z"):
            uid = int(fields.get("Uid", "-1").split()[0])
            yield int(entry.name), uid, int(fields.get("PPid", "0").strip() or 0)


def _uid_processes(uid: int) -> list[int]:
    """Live (non-zombie) processes whose real uid is ``uid``."""
    return [pid for pid, owner, _ in _live_processes() if owner == uid]


def kill_uid(uid: int, attempts: int = 5) -> None:
    """SIGKILL every process whose real uid is ``uid`` (needs root)."""
    for _ in range(attempts):
        if not _uid_processes(uid):
            return
        code = f"import os,signal;os.setgid({uid});os.setuid({uid});os.kill(-1,signal.SIGKILL)"
        subprocess.run(
            [sys.executable, "-I", "-S", "-c", code],
            env=SAFE_ENV,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
            check=False,
        )
        time.sleep(0.01)


@functools.cache
def _bwrap_works() -> bool:
    """Whether bubblewrap can build our sandbox here (it needs namespaces the kernel or a
    container may refuse)."""
    bwrap = shutil.which("bwrap")
    if bwrap is None:
        return False
    probe = [bwrap, *_bwrap_isolation(1), "--", "/bin/true"]
    try:
        return subprocess.run(probe, capture_output=True, timeout=20, check=False).returncode == 0
    except (OSError, subprocess.TimeoutExpired):
        return False


def sandbox_backend() -> str:
    """The backend in use: ``$RELAYRL_SANDBOX`` (``auto``, ``bwrap``, ``launcher``)."""
    wanted = os.environ.get("RELAYRL_SANDBOX", "auto")
    if wanted not in (*BACKENDS, "auto"):
        raise ValueError(f"RELAYRL_SANDBOX={wanted!r}; expected auto, bwrap or launcher")
    if wanted == "bwrap" and not _bwrap_works():
        raise RuntimeError(
            "RELAYRL_SANDBOX=bwrap but bubblewrap is missing or cannot create namespaces here "
            "(install Debian's 'bubblewrap'; check `bwrap --ro-bind / / true`)"
        )
    if wanted == "auto":
        return "bwrap" if _bwrap_works() else "launcher"
    return wanted


def _bwrap_isolation(disk_mb: int) -> list[str]:
    """bubblewrap options: fresh namespaces, a read-only root, private size-capped temp
    dirs, death with the parent."""
    size = str(disk_mb << 20)
    return [
        "--die-with-parent",
        "--new-session",
        "--unshare-net",
        "--unshare-ipc",
        "--unshare-uts",
        "--unshare-pid",
        "--unshare-cgroup-try",
        "--ro-bind", "/", "/",
        "--dev", "/dev",
        "--proc", "/proc",
        "--size", size, "--tmpfs", "/tmp",
        "--size", str(1 << 20), "--tmpfs", "/var/tmp",
        "--size", str(1 << 20), "--tmpfs", "/dev/shm",
    ]  # fmt: skip


def _free_uid() -> int:
    """A sandbox uid no live process has (root only), outside the launcher backend's range."""
    in_use = {uid for _, uid, _ in _live_processes()}
    while True:
        uid = BASE_UID + PID_SPACE + secrets.randbelow(1 << 24)
        if uid not in in_use:
            return uid


def start_sandbox(
    argv: list[str],
    files: dict[str, str | bytes],
    limits: SandboxLimits | None = None,
    pass_fds: tuple[int, ...] = (),
    env: dict[str, str] | None = None,
) -> SandboxProcess:
    """Start ``argv`` in a fresh sandbox whose working directory holds ``files``.

    ``argv[0]`` must be an absolute path; relative file arguments resolve in the working
    directory. ``pass_fds`` are inherited (e.g. pipes for a protocol with the parent).
    """
    limits = limits or SandboxLimits()
    base = Path(tempfile.mkdtemp(prefix="relayrl-sbx-"))
    work = base / "work"
    work.mkdir()
    for name, content in files.items():
        data = content.encode() if isinstance(content, str) else content
        (work / name).write_bytes(data)
    config = {
        **asdict(limits),
        "workdir": str(work),
        "base_uid": BASE_UID,
        "argv": argv,
        "env": {**SAFE_ENV, **(env or {})},
    }
    launch = [sys.executable, "-I", "-S", str(LAUNCHER)]
    uid = None
    if sandbox_backend() == "bwrap":
        uid = _free_uid() if os.geteuid() == 0 else None
        config.update(workdir="/tmp/input", isolated=True, uid=uid)
        bind = ["--ro-bind", str(work), "/tmp/input", "--chdir", "/tmp/input"]
        launch = [shutil.which("bwrap"), *_bwrap_isolation(limits.disk_mb), *bind, "--", *launch]
    with (base / "stdout").open("wb") as out, (base / "stderr").open("wb") as err:
        proc = subprocess.Popen(
            [*launch, json.dumps(config)],
            stdin=subprocess.DEVNULL,
            stdout=out,
            stderr=err,
            pass_fds=pass_fds,
            start_new_session=True,
            env=SAFE_ENV,
            cwd=str(work),
        )
    return SandboxProcess(proc, base, limits, uid)


def run_sandboxed(
    argv: list[str], files: dict[str, str | bytes], limits: SandboxLimits | None = None
) -> SandboxResult:
    """Run ``argv`` to completion (or to the wall-clock limit) in a fresh sandbox."""
    limits = limits or SandboxLimits()
    with start_sandbox(argv, files, limits) as box:
        finished = box.wait(limits.wall_s)
        if not finished:
            box.kill()
        return SandboxResult(
            returncode=box.proc.returncode if finished else None,
            timed_out=not finished,
            stdout=box.read_output("stdout"),
            stderr=box.read_output("stderr"),
            wall_s=time.monotonic() - box.started,
        )


def _world_runnable(path: Path) -> bool:
    """True when a user with no relation to the file's owner can execute ``path``."""
    real = path.resolve()
    if not real.is_file() or not os.stat(real).st_mode & stat.S_IXOTH:
        return False
    return all(os.stat(parent).st_mode & stat.S_IXOTH for parent in real.parents)


def sandbox_python() -> str:
    """The interpreter for sandboxed Python: ``$RELAYRL_SANDBOX_PYTHON``, else this one when
    the sandbox uid can run it, else ``/usr/bin/python3`` (e.g. when ours lives under a
    private ``/root``). Sandboxed code needs only the standard library."""
    env = os.environ.get("RELAYRL_SANDBOX_PYTHON")
    if env:
        return env
    if os.geteuid() != 0 or _world_runnable(Path(sys.executable)):
        return sys.executable
    for candidate in ("/usr/bin/python3", "/usr/local/bin/python3"):
        if Path(candidate).exists() and _world_runnable(Path(candidate)):
            return candidate
    return sys.executable


def python_argv(script: str, *args: str) -> list[str]:
    """An isolated-mode Python command line for a script in the working directory."""
    return [sandbox_python(), "-I", script, *args]


def kill_orphaned_sandboxes() -> None:
    """Kill sandbox processes left behind by a killed grading worker (root only).

    They run under uids from ``BASE_UID`` up and, once their parent is gone, are re-parented
    away from it; every such process whose parent is no longer a sandbox launcher's caller is
    killed by uid.
    """
    if os.geteuid() != 0:
        return
    for _, uid, ppid in _live_processes():
        if uid >= BASE_UID and (_parent_uid(ppid) not in (0, uid) or ppid == 1):
            kill_uid(uid)


def _parent_uid(pid: int) -> int:
    try:
        with open(f"/proc/{pid}/status", encoding="ascii", errors="replace") as f:
            for line in f:
                if line.startswith("Uid:"):
                    return int(line.split()[1])
    except OSError:
        pass
    return -1
