"""Start, watch and stop the rollout servers of a run.

Owns: :class:`ServerLauncher`. ``mode="process"`` (the real path) starts one
``relayrl serve`` child process per server on a free loopback port, each with its own torch
thread count, its output in ``<run>/server-<i>.log``, and (on Linux) a parent-death signal so
a killed trainer never leaves servers behind. ``mode="thread"`` runs the same HTTP server in
this process (tests). :meth:`ServerLauncher.check` raises a :class:`RelayError` naming a
server that died; :meth:`respawn` replaces one server by a fresh process on a new port (the
policy of when to do so is ``relayrl.launch.supervisor``'s); :meth:`kill` kills one (a hung
server); :meth:`stop` terminates every child (SIGTERM and SIGCONT, then SIGKILL).

Parent death: Linux delivers ``PR_SET_PDEATHSIG`` when the *thread* that forked the child
exits, not the process. Every server is therefore forked by one dedicated spawner thread that
lives until :meth:`stop`, whichever thread calls :meth:`start` or :meth:`respawn` (an
``asyncio.to_thread`` worker that exits soon after, say), and the child sets the signal itself
right after exec (:func:`serve_child`), so no Python code runs between fork and exec in a
process full of threads (``preexec_fn`` is not fork-safe there).

Imports: the engine's server module (thread mode only), the standard library otherwise.
"""

from __future__ import annotations

import contextlib
import ctypes
import os
import signal
import socket
import subprocess
import sys
import threading
import time
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from relayrl.errors import RelayError

SERVE_SNIPPET = (
    "import sys; from relayrl.launch.servers import serve_child; serve_child(sys.argv[1:])"
)
PARENT_ENV = "RELAYRL_SERVER_PARENT_PID"
PR_SET_PDEATHSIG = 1


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def die_with_parent(parent: int) -> None:
    """In a server process: get SIGTERM when the launcher's spawner thread (its parent) dies;
    exit now if process ``parent`` is already gone (it died before the signal was set)."""
    if not sys.platform.startswith("linux") or not parent:
        return
    with contextlib.suppress(Exception):
        ctypes.CDLL(None, use_errno=True).prctl(PR_SET_PDEATHSIG, signal.SIGTERM)
    if os.getppid() != parent:
        sys.exit(f"relayrl serve: the launching process {parent} is gone")


def serve_child(argv: list[str]) -> None:
    """Entry point of a server process (:data:`SERVE_SNIPPET`): ``relayrl <argv>``."""
    die_with_parent(int(os.environ.pop(PARENT_ENV, "0") or 0))
    from relayrl.cli import main

    sys.exit(main(argv))


def healthy(url: str, timeout: float = 1.0) -> bool:
    """Whether ``url`` answers ``GET /health`` with 200 within ``timeout`` seconds."""
    try:
        with urllib.request.urlopen(url + "/health", timeout=timeout) as r:
            return r.status == 200
    except OSError:
        return False


@dataclass
class ServerSpec:
    model_dir: str
    threads: int = 1
    max_running_requests: int = 128
    max_seq_len: int | None = None
    device: str = "cpu"
    dtype: str = "float32"


@dataclass
class ServerLauncher:
    """``num_servers`` rollout servers over ``spec``; use as a context manager."""

    spec: ServerSpec
    num_servers: int = 1
    mode: str = "process"
    log_dir: Path | None = None
    startup_timeout_s: float = 120.0
    urls: list[str] = field(default_factory=list)
    _procs: list[subprocess.Popen] = field(default_factory=list)
    _logs: list[Path] = field(default_factory=list)
    _threads: list[Any] = field(default_factory=list)
    _spawner: ThreadPoolExecutor | None = None
    _spawner_lock: threading.Lock = field(default_factory=threading.Lock)

    def __enter__(self) -> ServerLauncher:
        self.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()

    # ------------------------------------------------------------------ start
    def start(self) -> list[str]:
        try:
            if self.mode == "thread":
                for _ in range(self.num_servers):
                    self._start_thread()
            else:
                for i in range(self.num_servers):
                    self._start_process(i)
                self._wait_healthy()
        except BaseException:
            self.stop()
            raise
        return self.urls

    def _command(self, port: int) -> list[str]:
        s = self.spec
        cmd = [sys.executable, "-c", SERVE_SNIPPET, "serve", "--model", s.model_dir]
        cmd += ["--port", str(port), "--threads", str(s.threads), "--device", s.device]
        cmd += ["--dtype", s.dtype, "--max-running-requests", str(s.max_running_requests)]
        if s.max_seq_len:
            cmd += ["--max-seq-len", str(s.max_seq_len)]
        return cmd

    def _start_process(self, i: int) -> None:
        proc, log, url = self._spawn(i, "w")
        self._procs.append(proc)
        self._logs.append(log)
        self.urls.append(url)

    def _spawn(self, i: int, log_mode: str) -> tuple[subprocess.Popen, Path, str]:
        """Start server ``i`` from the spawner thread (see the module docstring)."""
        with self._spawner_lock:
            if self._spawner is None:
                self._spawner = ThreadPoolExecutor(1, thread_name_prefix="relayrl-server-spawner")
            spawner = self._spawner
        return spawner.submit(self._popen, i, log_mode).result()

    def _popen(self, i: int, log_mode: str) -> tuple[subprocess.Popen, Path, str]:
        port = free_port()
        log = (self.log_dir or Path("/tmp")) / f"server-{i}.log"
        log.parent.mkdir(parents=True, exist_ok=True)
        env = dict(os.environ, OMP_NUM_THREADS=str(self.spec.threads))
        env[PARENT_ENV] = str(os.getpid())
        with open(log, log_mode) as out:
            if log_mode == "a":
                out.write(f"\n----- restarted at {time.strftime('%Y-%m-%d %H:%M:%S')} -----\n")
                out.flush()
            proc = subprocess.Popen(
                self._command(port),
                stdout=out,
                stderr=subprocess.STDOUT,
                stdin=subprocess.DEVNULL,
                env=env,
            )
        return proc, log, f"http://127.0.0.1:{port}"

    def _wait_healthy(self, indices: list[int] | None = None) -> None:
        deadline = time.monotonic() + self.startup_timeout_s
        waiting = set(range(len(self._procs)) if indices is None else indices)
        while waiting:
            self.check()
            waiting = {i for i in waiting if not healthy(self.urls[i])}
            if waiting and time.monotonic() > deadline:
                i = min(waiting)
                raise RelayError(
                    f"rollout server {i} ({self.urls[i]}, pid {self._procs[i].pid}) did not "
                    f"become healthy within {self.startup_timeout_s:.0f}s; see {self._logs[i]}"
                )
            if waiting:
                time.sleep(0.2)

    def _start_thread(self) -> None:
        from relayrl.engine.engine import Engine
        from relayrl.engine.server import ServerThread, create_app
        from relayrl.engine.types import EngineOptions

        s = self.spec
        options = EngineOptions(
            device=s.device,
            dtype=s.dtype,
            max_running_requests=s.max_running_requests,
            max_seq_len=s.max_seq_len,
        )
        engine = Engine.from_pretrained(s.model_dir, options)
        server = ServerThread(create_app(engine)).start()
        self._threads.append((server, engine))
        self.urls.append(server.url)

    # ------------------------------------------------------------------ replace one
    @property
    def is_process_mode(self) -> bool:
        return self.mode != "thread"

    def index_of(self, url: str) -> int:
        try:
            return self.urls.index(url)
        except ValueError:
            raise RelayError(f"{url} is not one of this run's rollout servers") from None

    def exit_code(self, i: int) -> int | None:
        """Server ``i``'s exit status, or None while it runs (thread servers: always None)."""
        return self._procs[i].poll() if self.is_process_mode else None

    def kill(self, i: int) -> None:
        """SIGKILL server ``i`` (a hung one; a stopped process dies too) and reap it, so its
        connections break at once and :meth:`exit_code` reports it."""
        if not self.is_process_mode:
            return
        proc = self._procs[i]
        if proc.poll() is None:
            with contextlib.suppress(OSError):
                proc.kill()
        with contextlib.suppress(subprocess.TimeoutExpired):
            proc.wait(timeout=10)

    def respawn(self, i: int) -> str:
        """Replace server ``i`` (killed first if still running) by a fresh process on a new
        port, its output appended to the same log; returns its URL, not yet healthy (see
        :meth:`wait_healthy`). Safe from any thread: the spawner thread forks it."""
        if not self.is_process_mode:
            server, engine = self._threads[i]
            server.stop()
            engine.shutdown()
            self._threads.pop(i)
            self._start_thread()
            self._threads.insert(i, self._threads.pop())
            self.urls[i] = self.urls.pop()
            return self.urls[i]
        self.kill(i)
        self._procs[i], self._logs[i], self.urls[i] = self._spawn(i, "a")
        return self.urls[i]

    def wait_healthy(self, indices: list[int]) -> None:
        """Block until servers ``indices`` answer /health (RelayError after the startup
        timeout or if one exits)."""
        if self.is_process_mode:
            self._wait_healthy(indices)

    # ------------------------------------------------------------------ watch and stop
    @property
    def pids(self) -> list[int]:
        return [p.pid for p in self._procs]

    def check(self) -> None:
        """Raise a RelayError naming the first server process that has exited."""
        for i, proc in enumerate(self._procs):
            code = proc.poll()
            if code is not None:
                raise RelayError(self.describe(i, f"exited with code {code}"))

    def describe(self, i: int, what: str, consequence: str = "the run cannot continue") -> str:
        """``rollout server i (url, pid) <what>; <consequence> (log: ...); last output: ...``"""
        if not self.is_process_mode:
            return f"rollout server {i} ({self.urls[i]}, in-process) {what}; {consequence}"
        tail = ""
        with contextlib.suppress(OSError):
            lines = self._logs[i].read_text(errors="replace").strip().splitlines()
            tail = ("; last output: " + lines[-1][-300:]) if lines else ""
        return (
            f"rollout server {i} ({self.urls[i]}, pid {self._procs[i].pid}) {what}; "
            f"{consequence} (log: {self._logs[i]}){tail}"
        )

    def stop(self) -> None:
        for proc in self._procs:
            if proc.poll() is None:
                with contextlib.suppress(OSError):
                    proc.terminate()
                    proc.send_signal(signal.SIGCONT)  # a stopped (hung) server exits too
        deadline = time.monotonic() + 10
        for proc in self._procs:
            try:
                proc.wait(timeout=max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                with contextlib.suppress(OSError):
                    proc.kill()
                proc.wait(timeout=5)
        self._procs.clear()
        with self._spawner_lock:
            spawner, self._spawner = self._spawner, None
        if spawner is not None:  # after the children are gone: its exit is their parent death
            spawner.shutdown(wait=True)
        for server, engine in self._threads:
            server.stop()
            engine.shutdown()
        self._threads.clear()
