"""Run untrusted (model-written) programs in a sandbox subprocess.

Two backends (``$RELAYRL_SANDBOX``: ``auto`` (default), ``bwrap`` or ``launcher``):

* ``bwrap`` — Debian's bubblewrap builds the isolation: new network, pid, ipc and uts
  namespaces, an **empty root** holding only read-only binds of ``/usr``, ``/lib*``, a few
  ``/etc`` files and the interpreter's own prefix (wherever it lives, ``/tmp`` included),
  size-capped private ``/tmp``, ``/var/tmp`` and ``/dev/shm``, and the run dies with its
  parent; inside it the launcher sets the rlimits, no-new-privs and the per-run uid, then
  ``exec``s the command. ``auto`` picks it when ``bwrap`` is installed and works here.
* ``launcher`` — the fallback with no extra package: ``python -I -S _sandbox_launch.py``
  makes the same namespaces and the same minimal root itself (``pivot_root``), and refuses
  to run the command when the kernel will not let it, unless the opt-out is set.

Neither shows the sandboxed code the datasets it is graded on, the project tree, homes,
checkpoints, ``runs/`` or host sockets. :func:`start_sandbox` creates a throw-away
directory, writes the given files there and starts the backend in a new session. The
environment is scrubbed to a fixed minimum, stdout/stderr go to files capped by
RLIMIT_FSIZE, and on exit or timeout everything the run started is killed: its process
group, then every process owned by its uid (``kill(-1)`` as that uid, which the kernel
applies atomically, so a fork bomb cannot outrun it). See docs/graders.md for what this does
and does not protect against.
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
from collections.abc import Iterator
from dataclasses import asdict, dataclass
from pathlib import Path

from relayrl.errors import RelayError

LAUNCHER = Path(__file__).with_name("_sandbox_launch.py")
LAUNCH_PATH = "/run/relayrl-launch.py"  # where bwrap shows the launcher (that file only)
# sandbox uids (root only): BASE_UID + a random number, unused and registered (_register)
BASE_UID = 200_000
BACKENDS = ("bwrap", "launcher")
SAFE_ENV = {"PATH": "/usr/local/bin:/usr/bin:/bin", "LANG": "C.UTF-8", "HOME": "/nonexistent"}
ALLOW_UNISOLATED_ENV = "RELAYRL_SANDBOX_ALLOW_UNISOLATED"
SYSTEM_DIRS = ("/usr", "/bin", "/sbin", "/lib", "/lib32", "/lib64", "/libx32")
ETC_FILES = ("/etc/ld.so.cache", "/etc/ld.so.conf", "/etc/localtime")


class SandboxUnavailable(RelayError):
    """The sandbox cannot run model-written code safely here; the run must stop."""

    fatal = True


@dataclass(frozen=True)
class SandboxLimits:
    """Per-run limits. ``file_bytes`` caps every file the program writes, stdout included;
    ``memory_mb`` is the whole run's address space: each of at most ``nproc`` processes
    (threads count) gets ``memory_mb / nproc``."""

    wall_s: float = 10.0
    cpu_s: int = 10
    memory_mb: int = 1024
    nproc: int = 4
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
        self, proc: subprocess.Popen, base: Path, limits: SandboxLimits, uid: int | None
    ) -> None:
        self.proc = proc
        self.base = base
        self.limits = limits
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
        if self.uid is not None:
            _unregister(self.uid)

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
    mounts = _bwrap_mounts(_system_mounts("/bin/true"))
    probe = [bwrap, *_bwrap_isolation(1), *mounts, "--", "/bin/true"]
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
            "(install Debian's 'bubblewrap'; check `bwrap --ro-bind /usr /usr true`)"
        )
    if wanted == "auto":
        return "bwrap" if _bwrap_works() else "launcher"
    return wanted


def allow_unisolated() -> bool:
    """The documented opt-out (``sandbox.allow_unisolated`` /
    ``$RELAYRL_SANDBOX_ALLOW_UNISOLATED=1``): run model-written code even where no
    namespace can be made."""
    return os.environ.get(ALLOW_UNISOLATED_ENV, "") in ("1", "true", "yes")


@contextlib.contextmanager
def sandbox_settings(allow_unisolated_runs: bool) -> Iterator[None]:
    """The run config's ``sandbox`` section applied to this process and the grading workers
    it spawns inside the ``with`` block (they inherit the environment); the variable is
    restored on exit, so an opt-out never outlives its run (a benchmark or experiment that
    runs several in one process, issue 46)."""
    before = os.environ.get(ALLOW_UNISOLATED_ENV)
    if allow_unisolated_runs:
        os.environ[ALLOW_UNISOLATED_ENV] = "1"
    try:
        yield
    finally:
        if before is None:
            os.environ.pop(ALLOW_UNISOLATED_ENV, None)
        else:
            os.environ[ALLOW_UNISOLATED_ENV] = before


def _bwrap_isolation(disk_mb: int) -> list[str]:
    """bubblewrap options: fresh namespaces, an empty root, private size-capped temp dirs,
    death with the parent."""
    size = str(disk_mb << 20)
    return [
        "--die-with-parent",
        "--new-session",
        "--unshare-net",
        "--unshare-ipc",
        "--unshare-uts",
        "--unshare-pid",
        "--unshare-cgroup-try",
        "--dev", "/dev",
        "--proc", "/proc",
        "--size", size, "--tmpfs", "/tmp",
        "--size", str(1 << 20), "--tmpfs", "/var/tmp",
        "--size", str(1 << 20), "--tmpfs", "/dev/shm",
    ]  # fmt: skip


def _covered(path: str, dirs: list[str]) -> bool:
    return any(path == d or path.startswith(d.rstrip("/") + "/") for d in dirs)


def _interpreter_prefixes(python: str) -> list[str]:
    """The directories an interpreter needs: its (base) prefixes, resolved."""
    real = os.path.realpath(python)
    base = os.path.realpath(getattr(sys, "_base_executable", sys.executable))
    if real == base:
        found = [os.path.realpath(sys.base_prefix), os.path.realpath(sys.base_exec_prefix)]
    else:  # another interpreter: <prefix>/bin/python
        found = [str(Path(real).parent.parent)]
    return list(dict.fromkeys(found))


@functools.cache
def _system_mounts(python: str | None = None) -> tuple[tuple[str, str, str], ...]:
    """What a sandbox sees of the host, as (kind, source, target): read-only binds of
    ``/usr``, ``/lib*`` (symlinks where the host has them), a few ``/etc`` files and the
    interpreter's own prefix — wherever it lives, ``/tmp`` included."""
    mounts: list[tuple[str, str, str]] = []
    bound: list[str] = []
    for top in SYSTEM_DIRS:
        if os.path.islink(top):
            mounts.append(("symlink", os.readlink(top), top))
        elif os.path.isdir(top):
            mounts.append(("bind", top, top))
            bound.append(top)
    for prefix in _interpreter_prefixes(python or sandbox_python()):
        if not _covered(prefix, bound) and prefix != "/":
            mounts.append(("bind", prefix, prefix))
            bound.append(prefix)
    mounts.extend(("file", path, path) for path in ETC_FILES if os.path.isfile(path))
    return tuple(mounts)


def _bwrap_mounts(mounts: tuple[tuple[str, str, str], ...]) -> list[str]:
    """bubblewrap options for :func:`_system_mounts`; the parents of a bind are made 0755
    (bwrap would copy the host's mode: a bind under a 0700 ``/root`` would be unreachable
    for the sandbox uid)."""
    args: list[str] = []
    made = {"/", "/tmp"}
    for kind, source, target in mounts:
        if kind == "symlink":
            args += ["--symlink", source, target]
            continue
        for parent in reversed(Path(target).parents):
            if str(parent) not in made:
                args += ["--perms", "0755", "--dir", str(parent)]
                made.add(str(parent))
        args += ["--ro-bind", source, target]
        made.add(target)
    return args


def _extra_mounts(paths: tuple[str, ...]) -> tuple[tuple[str, str, str], ...]:
    """Read-only binds of ``paths`` (resolved) at the same place: directories whole, files
    alone."""
    mounts = []
    for path in dict.fromkeys(os.path.realpath(p) for p in paths):
        if os.path.isdir(path):
            mounts.append(("bind", path, path))
        elif os.path.isfile(path):
            mounts.append(("file", path, path))
    return tuple(mounts)


def _free_uid() -> int:
    """A sandbox uid no live process has and no registered run holds (root only)."""
    in_use = {uid for _, uid, _ in _live_processes()}
    while True:
        uid = BASE_UID + secrets.randbelow(1 << 24)
        if uid not in in_use and not (_registry_dir() / str(uid)).exists():
            return uid


def _process_memory_bytes(limits: SandboxLimits) -> int:
    """RLIMIT_AS of each process: the run's budget split over the processes it may have
    (RLIMIT_NPROC), so that together they stay within ``memory_mb``."""
    return (limits.memory_mb << 20) // max(1, limits.nproc)


def _launch_command(backend: str, config: dict, work: Path, limits: SandboxLimits) -> list[str]:
    """The backend's command line (the config JSON goes last). The stand-alone launcher
    runs under this process's interpreter (on the host, before it isolates itself); under
    bwrap it runs under the sandbox's interpreter, inside the new root."""
    if backend != "bwrap":
        return [sys.executable, "-I", "-S", str(LAUNCHER)]
    config.update(workdir="/tmp/input", isolated=True)
    inside = ["--ro-bind", str(LAUNCHER), LAUNCH_PATH, "--ro-bind", str(work), "/tmp/input"]
    return [
        shutil.which("bwrap") or "bwrap",
        *_bwrap_isolation(limits.disk_mb),
        *_bwrap_mounts(config["mounts"]),
        *inside,
        "--chdir", "/tmp/input",
        "--", sandbox_python(), "-I", "-S", LAUNCH_PATH,
    ]  # fmt: skip


def start_sandbox(
    argv: list[str],
    files: dict[str, str | bytes],
    limits: SandboxLimits | None = None,
    pass_fds: tuple[int, ...] = (),
    env: dict[str, str] | None = None,
    binds: tuple[str, ...] = (),
) -> SandboxProcess:
    """Start ``argv`` in a fresh sandbox whose working directory holds ``files``.

    ``argv[0]`` must be an absolute path; relative file arguments resolve in the working
    directory. ``pass_fds`` are inherited (e.g. pipes for a protocol with the parent).
    ``binds``: more host directories or files shown read-only at the same path (the
    packages an isolated grader imports, :mod:`relayrl.rewards.isolated`).
    """
    limits = limits or SandboxLimits()
    base = Path(tempfile.mkdtemp(prefix="relayrl-sbx-"))
    work, root = base / "work", base / "root"
    work.mkdir()
    root.mkdir()
    for name, content in files.items():
        data = content.encode() if isinstance(content, str) else content
        (work / name).write_bytes(data)
    try:
        backend = sandbox_backend()
    except (ValueError, RuntimeError) as exc:
        shutil.rmtree(base, ignore_errors=True)
        raise SandboxUnavailable(f"sandbox: {exc}") from exc
    uid = _free_uid() if os.geteuid() == 0 else None
    config = {
        **asdict(limits),
        "process_memory_bytes": _process_memory_bytes(limits),
        "workdir": str(work),
        "root": str(root),
        "mounts": (*_system_mounts(argv[0]), *_extra_mounts(binds)),
        "uid": uid,
        "allow_unisolated": allow_unisolated(),
        "argv": argv,
        "env": {**SAFE_ENV, **(env or {})},
    }
    launch = _launch_command(backend, config, work, limits)
    if uid is not None:
        _register(uid, base)
    try:
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
    except OSError as exc:
        shutil.rmtree(base, ignore_errors=True)
        if uid is not None:
            _unregister(uid)
        raise SandboxUnavailable(f"sandbox backend {backend!r} cannot start: {exc}") from exc
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


REFUSED_EXIT = 125  # the launcher's exit status when it refuses to run unisolated
PROBE_GOOD = "print('relayrl-sandbox-ok')\n"
PROBE_BAD = (
    "import sys\ntry:\n    print(open({path!r}).read())\nexcept OSError:\n    pass\nsys.exit(3)\n"
)


def _cause(result: SandboxResult) -> str:
    lines = result.stderr.decode("utf-8", "replace").strip().splitlines()
    if result.timed_out:
        return "it did not finish in time"
    return f"exit {result.returncode}" + (f": {lines[-1][:300]}" if lines else " (no output)")


def probe_sandbox() -> str:
    """Run a known-good and a known-bad program through the real backend; the backend's
    name, or :class:`SandboxUnavailable` saying which backend failed and why.

    Good: prints a token and exits 0. Bad: tries to read a file planted on the host, then
    exits 3; it must not see the file (unless the unisolated opt-out is set) and its exit
    status must come back."""
    try:
        backend = sandbox_backend()
    except (ValueError, RuntimeError) as exc:
        raise SandboxUnavailable(f"sandbox: {exc}") from exc
    limits = SandboxLimits(wall_s=30.0, cpu_s=10, memory_mb=512)
    good = run_sandboxed(python_argv("probe.py"), {"probe.py": PROBE_GOOD}, limits)
    if good.returncode != 0 or good.stdout.strip() != b"relayrl-sandbox-ok":
        hint = ""
        if good.returncode == REFUSED_EXIT:
            hint = (
                "; to run model-written code anyway, without isolation, set "
                f"sandbox.allow_unisolated=true ({ALLOW_UNISOLATED_ENV}=1): docs/security.md"
            )
        raise SandboxUnavailable(
            f"sandbox backend {backend!r} failed its probe (a known-good program): "
            f"{_cause(good)}{hint}"
        )
    planted = Path(tempfile.mkdtemp(prefix="relayrl-probe-"))
    try:
        secret = secrets.token_hex(16)
        (planted / "secret").write_text(secret, encoding="utf-8")
        planted.chmod(0o755)
        (planted / "secret").chmod(0o644)
        program = PROBE_BAD.format(path=str(planted / "secret"))
        bad = run_sandboxed(python_argv("probe.py"), {"probe.py": program}, limits)
    finally:
        shutil.rmtree(planted, ignore_errors=True)
    if bad.returncode != 3:
        raise SandboxUnavailable(
            f"sandbox backend {backend!r} failed its probe (a known-bad program should exit "
            f"3): {_cause(bad)}"
        )
    if secret.encode() in bad.stdout and not allow_unisolated():
        raise SandboxUnavailable(
            f"sandbox backend {backend!r} failed its probe: a sandboxed program read a "
            f"file on the host ({planted}/secret)"
        )
    return backend


@functools.cache
def checked_backend() -> str:
    """:func:`probe_sandbox`, once per process (the python tool calls it before each run)."""
    return probe_sandbox()


def _world_runnable(path: Path) -> bool:
    """True when a user with no relation to the file's owner can execute ``path``."""
    real = path.resolve()
    if not real.is_file() or not os.stat(real).st_mode & stat.S_IXOTH:
        return False
    return all(os.stat(parent).st_mode & stat.S_IXOTH for parent in real.parents)


def sandbox_python() -> str:
    """The interpreter for sandboxed Python: ``$RELAYRL_SANDBOX_PYTHON``, else the real
    (base) interpreter behind this one, resolved out of any virtual environment, whose
    prefix the sandbox binds wherever it lives. Sandboxed code needs only the standard
    library. Under the unisolated opt-out as root, a world-executable one (the sandbox uid
    sees the host's tree, e.g. a private ``/root``)."""
    env = os.environ.get("RELAYRL_SANDBOX_PYTHON")
    if env:
        return env
    ours = os.path.realpath(getattr(sys, "_base_executable", None) or sys.executable)
    if os.geteuid() != 0 or not allow_unisolated() or _world_runnable(Path(ours)):
        return ours
    for candidate in ("/usr/bin/python3", "/usr/local/bin/python3"):
        if Path(candidate).exists() and _world_runnable(Path(candidate)):
            return candidate
    return ours


def python_argv(script: str, *args: str) -> list[str]:
    """An isolated-mode Python command line for a script in the working directory."""
    return [sandbox_python(), "-I", script, *args]


# -- the registry of sandbox uids --------------------------------------------------------------


def _registry_dir() -> Path:
    """Where each live run's uid is registered (root only): one file per uid naming the
    process that owns the run; :func:`kill_orphaned_sandboxes` kills only these uids.

    Under a directory only this user can create entries in, never at a fixed name in a
    shared one (another user who pre-created ``/tmp/relayrl-sandbox-uids`` blocked every
    code grade): ``/run`` (root's, a tmpfs: registrations end with the boot), else
    ``$XDG_RUNTIME_DIR``, else ``~/.cache``."""
    for parent in (Path("/run"), Path(os.environ.get("XDG_RUNTIME_DIR") or "/nonexistent")):
        if _private_parent(parent):
            return parent / f"relayrl-sandbox-uids-{os.geteuid()}"
    return Path.home() / ".cache" / "relayrl" / "sandbox-uids"


def _private_parent(directory: Path) -> bool:
    """A directory of ours (or root's) that no other user may create names in."""
    try:
        info = os.stat(directory)
    except OSError:
        return False
    owner_ok = info.st_uid in (0, os.geteuid())
    return owner_ok and not info.st_mode & 0o022 and os.access(directory, os.W_OK)


def _start_ticks(pid: int) -> str | None:
    """A process's start time (clock ticks since boot), to tell a pid from its reuse."""
    try:
        with open(f"/proc/{pid}/stat", encoding="ascii", errors="replace") as f:
            return f.read().rsplit(")", 1)[1].split()[19]
    except (OSError, IndexError):
        return None


def _registry_is_ours(directory: Path) -> bool:
    """A real 0700 directory owned by us (not one another user planted in /tmp)."""
    try:
        info = os.lstat(directory)
    except OSError:
        return False
    private = stat.S_ISDIR(info.st_mode) and not info.st_mode & 0o077
    return private and info.st_uid == os.geteuid()


def _register(uid: int, base: Path) -> None:
    directory = _registry_dir()
    directory.parent.mkdir(mode=0o700, parents=True, exist_ok=True)
    with contextlib.suppress(FileExistsError):
        directory.mkdir(mode=0o700)
    if not _registry_is_ours(directory):
        raise SandboxUnavailable(
            f"sandbox: {directory} must be a directory of mode 0700 owned by uid "
            f"{os.geteuid()} (it registers the sandbox uids); remove it"
        )
    owner = {"pid": os.getpid(), "start": _start_ticks(os.getpid()), "base": str(base)}
    (directory / str(uid)).write_text(json.dumps(owner), encoding="utf-8")


def _unregister(uid: int) -> None:
    with contextlib.suppress(OSError):
        (_registry_dir() / str(uid)).unlink()


def registered_uids() -> dict[int, dict]:
    """uid -> {pid, start, base} of every registered sandbox run on this machine."""
    found: dict[int, dict] = {}
    if not _registry_is_ours(_registry_dir()):
        return found
    with contextlib.suppress(OSError):
        for entry in _registry_dir().iterdir():
            with contextlib.suppress(OSError, ValueError):
                if entry.name.isdigit() and int(entry.name) >= BASE_UID:
                    found[int(entry.name)] = json.loads(entry.read_text(encoding="utf-8"))
    return found


def kill_orphaned_sandboxes() -> list[int]:
    """Kill the runs of sandbox owners that died (a killed grading worker); root only.

    Only uids a sandbox registered are touched, and only when the process that registered
    the uid is gone (pid dead, or reused: its start time differs); the uids killed."""
    if os.geteuid() != 0:
        return []
    killed = []
    for uid, owner in registered_uids().items():
        if _start_ticks(int(owner.get("pid", 0))) == owner.get("start"):
            continue  # its owner is alive: not an orphan
        kill_uid(uid)
        base = Path(str(owner.get("base", "")))
        if base.name.startswith("relayrl-sbx-"):
            shutil.rmtree(base, ignore_errors=True)
        _unregister(uid)
        killed.append(uid)
    return killed
