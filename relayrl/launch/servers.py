"""Start, watch and stop the rollout servers of a run.

Owns: :class:`ServerLauncher`. ``mode="process"`` (the real path) starts one
``relayrl serve`` child process per server on a free loopback port, each with its own torch
thread count, its output in ``<run>/server-<i>.log``, and (on Linux) a parent-death signal so
a killed trainer never leaves servers behind. ``mode="thread"`` runs the same HTTP server in
this process (tests). :meth:`ServerLauncher.check` raises a :class:`RelayError` naming a
server that died; :meth:`respawn` replaces one server by a fresh process on a new port (the
policy of when to do so is ``relayrl.launch.supervisor``'s); :meth:`stop` terminates every
child (SIGTERM, then SIGKILL).

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
import time
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from relayrl.errors import RelayError

SERVE_SNIPPET = "import sys; from relayrl.cli import main; sys.exit(main(sys.argv[1:]))"


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _die_with_parent() -> None:  # runs in the child between fork and exec
    with contextlib.suppress(Exception):
        libc = ctypes.CDLL("libc.so.6", use_errno=True)
        libc.prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG


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
        port = free_port()
        log = (self.log_dir or Path("/tmp")) / f"server-{i}.log"
        log.parent.mkdir(parents=True, exist_ok=True)
        env = dict(os.environ, OMP_NUM_THREADS=str(self.spec.threads))
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
                preexec_fn=_die_with_parent if sys.platform.startswith("linux") else None,
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

    def respawn(self, i: int) -> str:
        """Replace server ``i`` (killed first if still running) by a fresh process on a new
        port, its output appended to the same log; returns its URL, not yet healthy (see
        :meth:`wait_healthy`). Call it from the thread that started the servers: the
        parent-death signal follows the thread that forked."""
        if not self.is_process_mode:
            server, engine = self._threads[i]
            server.stop()
            engine.shutdown()
            self._threads.pop(i)
            self._start_thread()
            self._threads.insert(i, self._threads.pop())
            self.urls[i] = self.urls.pop()
            return self.urls[i]
        old = self._procs[i]
        if old.poll() is None:
            with contextlib.suppress(OSError):
                old.kill()
            old.wait(timeout=10)
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
        deadline = time.monotonic() + 10
        for proc in self._procs:
            try:
                proc.wait(timeout=max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                with contextlib.suppress(OSError):
                    proc.kill()
                proc.wait(timeout=5)
        self._procs.clear()
        for server, engine in self._threads:
            server.stop()
            engine.shutdown()
        self._threads.clear()
