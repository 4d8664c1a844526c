"""Start, watch and stop the rollout servers of a run.

Owns: :class:`ServerLauncher` and :class:`ServerSpec` (the built-in engine's server).
``mode="process"`` (the real path) starts one child process per server on a loopback port
(free, or ``spec.port + i`` when the spec fixes one), each with the environment its spec
asks for, its output in ``<run>/server-<i>.log``, and (on Linux) a parent-death signal so a
killed trainer never leaves servers behind. What the child runs is its spec's
:meth:`~ServerSpec.command`: ``relayrl.engine.serve.serve_main`` for the built-in engine
(:func:`serve_child`), a vLLM server for ``relayrl.launch.vllm.VLLMServerSpec``. A spec with
``new_session`` (vLLM, which forks an engine-core and a worker process) gets a process group
of its own, and every signal goes to the whole group, so no grandchild outlives it.
``mode="thread"`` runs the built-in HTTP server in this process (tests).

Keys (docs/security.md): a spec's ``api_key`` is the run key, which no server receives.
Server ``i`` in its ``j``-th incarnation (0 at start, one more at each :meth:`respawn`) gets
its own key, ``relayrl.runkey.server_key(run key, i, j)`` (:meth:`ServerLauncher.key_of`,
:meth:`ServerLauncher.spec_for`), in its environment (``RELAYRL_API_KEY``), never in its
command line, which every user of the machine can read: a key taken from one server opens
neither another server nor its own restart. The run's client sends each server its key
(:meth:`ServerLauncher.client_keys`).

Ports nobody can squat (docs/security.md): the launcher binds each server's port itself
(:func:`reserve_port`) and the child inherits the listening socket (``pass_fds``, its number
in ``RELAYRL_LISTEN_FD``), so no other process can take the port between its choice and the
server's start; the launcher keeps its copy until :meth:`stop`, and when a server exits the
copy stops listening but keeps the port (:func:`unlisten`): connections to a dead server are
refused, as before, and nobody else can bind its port while the run may still send to it.
A keyed server is healthy only when ``GET /health`` carries the proof that it holds the key
(:func:`health_state`, ``relayrl.runkey.health_proof``): the key is never sent to find out.
:class:`ExternalServers` (servers someone else started) holds the same test before the
client's first request carries the key to them.
:meth:`ServerLauncher.check` raises a :class:`RelayError` naming a server that died (with
the most telling line of its log); :meth:`respawn` replaces one server by a fresh process
(the policy of when to do so is ``relayrl.launch.supervisor``'s); :meth:`kill` kills one (a
hung server); :meth:`stop` terminates every child (SIGTERM and SIGCONT, then SIGKILL).

Parent death: Linux delivers ``PR_SET_PDEATHSIG`` when the *thread* that forked the child
exits, not the process. Every server is therefore forked by one dedicated spawner thread that
lives until :meth:`stop`, whichever thread calls :meth:`start` or :meth:`respawn` (an
``asyncio.to_thread`` worker that exits soon after, say), and the child sets the signal itself
right after exec (:func:`serve_child`, or the vLLM spec's launch snippet), so no Python code
runs between fork and exec in a process full of threads (``preexec_fn`` is not fork-safe
there).

Imports: relayrl.engine (the server entry point; the server module in thread mode only),
relayrl.errors, the standard library.
"""

from __future__ import annotations

import contextlib
import ctypes
import hmac
import os
import re
import secrets
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

from relayrl.errors import RelayError
from relayrl.plugins import plugin_environment
from relayrl.runkey import (
    API_KEY_ENV,
    CHALLENGE_HEADER,
    PROOF_HEADER,
    health_proof,
    server_key,
    transfer_secret,
)

# argv: ``serve`` (so ``ps`` and the tests can tell a server), then the ServeOptions JSON
SERVE_SNIPPET = (
    "import sys; from relayrl.launch.servers import serve_child; serve_child(sys.argv[2])"
)
PARENT_ENV = "RELAYRL_SERVER_PARENT_PID"
LISTEN_FD_ENV = "RELAYRL_LISTEN_FD"  # the inherited listening socket's fd number
PR_SET_PDEATHSIG = 1
BACKLOG = 2048  # uvicorn's


def free_port(host: str = "127.0.0.1") -> int:
    with socket.socket(_family(host), socket.SOCK_STREAM) as s:
        s.bind((host, 0))
        return s.getsockname()[1]


def _family(host: str) -> socket.AddressFamily:
    return socket.AF_INET6 if ":" in host else socket.AF_INET


def reserve_port(host: str, port: int | None) -> socket.socket:
    """A socket listening on ``host:port`` (``port`` None: a free one), for a server process
    to inherit. Bound by its number even when free (a port the kernel picks at bind time
    would be given up by :func:`unlisten`); OSError if ``port`` is taken."""
    for _ in range(32):  # a free port taken by someone else in between: pick another
        number = free_port(host) if port is None else port
        sock = socket.socket(_family(host), socket.SOCK_STREAM)
        try:
            sock.bind((host, number))
        except OSError:
            sock.close()
            if port is not None:
                raise
            continue
        sock.listen(BACKLOG)
        return sock
    raise OSError(f"no free port on {host} after 32 tries")


def unlisten(sock: socket.socket) -> None:
    """Stop ``sock`` listening but keep its port bound: connections are refused and no
    other process can bind the port (Linux: SHUT_RD on a listening socket)."""
    with contextlib.suppress(OSError):
        sock.shutdown(socket.SHUT_RD)


def die_with_parent(parent: int) -> None:
    """In a server process: get SIGTERM when the launcher's spawner thread (its parent) dies;
    exit now if process ``parent`` is already gone (it died before the signal was set)."""
    if not sys.platform.startswith("linux") or not parent:
        return
    with contextlib.suppress(Exception):
        ctypes.CDLL(None, use_errno=True).prctl(PR_SET_PDEATHSIG, signal.SIGTERM)
    if os.getppid() != parent:
        sys.exit(f"relayrl serve: the launching process {parent} is gone")


def serve_child(options_json: str) -> None:
    """Entry point of a built-in server process (:data:`SERVE_SNIPPET`): ``serve_main`` on
    the :class:`ServeOptions` in ``options_json``; a RelayError is one ``error:`` line."""
    die_with_parent(int(os.environ.pop(PARENT_ENV, "0") or 0))
    from relayrl.engine.serve import ServeOptions, serve_main
    from relayrl.plugins import load_plugins_from_env

    try:
        load_plugins_from_env()
        options = ServeOptions.from_json(options_json)
        # the key comes in the environment, never in argv; no grandchild inherits it
        options.api_key = os.environ.pop(API_KEY_ENV, None) or options.api_key
        fd = os.environ.pop(LISTEN_FD_ENV, "")
        options.listen_fd = int(fd) if fd.isdigit() else None
        sys.exit(serve_main(options))
    except RelayError as exc:
        print(f"error: {exc}", file=sys.stderr, flush=True)
        sys.exit(exc.exit_code)


ERROR_MARKERS = ("error", "exception", "killed", "denied")
EXCEPTION_LINE = re.compile(r"\b[A-Za-z_][\w.]*(Error|Exception|Exit)\b: ")


def telling_line(log: Path, window: int = 80) -> str:
    """The line of ``log`` that best says why a server failed: among its last ``window``
    lines, the last Python exception line (``SomeError: message``, with the indented detail
    line after it, e.g. pydantic's), else the last error-looking line, else the last line
    ('' if none)."""
    try:
        lines = [ln.rstrip() for ln in log.read_text(errors="replace").splitlines() if ln.strip()]
    except OSError:
        return ""
    tail = lines[-window:]
    for i in range(len(tail) - 1, -1, -1):
        if EXCEPTION_LINE.search(tail[i]):
            detail = [
                ln.strip()
                for ln in tail[i + 1 : i + 3]
                if ln.startswith((" ", "\t")) and "further information" not in ln
            ]
            return " | ".join([tail[i].strip(), *detail])[:400]
    for line in reversed(tail):
        if any(m in line.lower() for m in ERROR_MARKERS):
            return line.strip()[-400:]
    return tail[-1].strip()[-400:] if tail else ""


def healthy(url: str, timeout: float = 1.0) -> bool:
    """Whether ``url`` answers ``GET /health`` with 200 within ``timeout`` seconds."""
    try:
        with urllib.request.urlopen(url + "/health", timeout=timeout) as r:
            return r.status == 200
    except OSError:
        return False


UP, DOWN, UNPROVEN = "up", "down", "unproven"


def url_port(url: str) -> int:
    """The TCP port ``url`` connects to (its scheme's default when it names none)."""
    parts = urlsplit(url)
    return parts.port or (443 if parts.scheme == "https" else 80)


def health_state(url: str, key: str | None, timeout: float = 1.0) -> str:
    """``GET /health`` on ``url`` with a fresh challenge: :data:`UP` if it answers 200 and,
    when ``key`` is given, the proof that it holds ``key`` (``x-relayrl-proof``);
    :data:`UNPROVEN` if it answers 200 without that proof (not the server the key belongs
    to); :data:`DOWN` otherwise. The key itself is never sent."""
    challenge = secrets.token_hex(16)
    request = urllib.request.Request(url + "/health", headers={CHALLENGE_HEADER: challenge})
    try:
        with urllib.request.urlopen(request, timeout=timeout) as r:
            if r.status != 200:
                return DOWN
            proof = r.headers.get(PROOF_HEADER) or ""
    except OSError:
        return DOWN
    if key is None:
        return UP
    expected = health_proof(key, url_port(url), challenge)
    return UP if hmac.compare_digest(proof, expected) else UNPROVEN


def index_of(urls: list[str], url: str) -> int:
    """Position of ``url`` among a run's server ``urls`` (RelayError if absent)."""
    try:
        return urls.index(url)
    except ValueError:
        raise RelayError(f"{url} is not one of this run's rollout servers") from None


@dataclass
class ServerSpec:
    """A built-in engine server (``serve_main``) over ``model_dir``."""

    model_dir: str
    threads: int = 1
    max_running_requests: int = 128
    max_seq_len: int | None = None
    device: str = "cpu"
    dtype: str = "float32"
    max_adapters: int = 1  # LoRA adapter versions served at once (EngineOptions)
    share_prefill: bool = True  # a group's prompt prefilled once (EngineOptions)
    kind = "relayrl serve"
    new_session = False  # one process, no children of its own
    port: int | None = None  # fixed first port (None: free ports)
    host: str = "127.0.0.1"  # the address it listens on (a Ray node's own, on a cluster)
    # the key every request but /health needs; handed over in the environment (not argv)
    api_key: str | None = field(default=None, repr=False)
    # the user's plugins (relayrl.plugins), taken where the spec is made: a Ray actor that
    # starts the server on another node does not share this process's environment
    plugins_env: dict[str, str] = field(default_factory=plugin_environment)

    def engine_options(self):
        from relayrl.engine.types import EngineOptions

        return EngineOptions(
            device=self.device,
            dtype=self.dtype,
            max_running_requests=self.max_running_requests,
            max_seq_len=self.max_seq_len,
            max_adapters=self.max_adapters,
            share_prefill=self.share_prefill,
        )

    def command(self, port: int) -> list[str]:
        from relayrl.engine.serve import ServeOptions

        options = ServeOptions(
            self.model_dir,
            host=self.host,
            port=port,
            threads=self.threads,
            engine=self.engine_options(),
            # a spec built without a key (tests, embedding) drives its own servers' weights
            # on loopback, as documented; every backend's spec has a key
            open_control_plane=not self.api_key,
        )
        return [sys.executable, "-c", SERVE_SNIPPET, "serve", options.to_json()]

    def environment(self, index: int) -> dict[str, str]:
        env = {"OMP_NUM_THREADS": str(self.threads), **self.plugins_env}
        if self.api_key:
            env[API_KEY_ENV] = self.api_key
        return env


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
    # every server process started and the listening socket it inherited, kept (and its
    # port with it) until stop(); the watcher unlistens the socket of an exited server
    _held: list[tuple[subprocess.Popen, socket.socket]] = field(default_factory=list)
    _watcher: threading.Thread | None = None
    _stopping: threading.Event = field(default_factory=threading.Event)
    # server i's current incarnation: 0 at start, one more at each respawn (its key's)
    _incarnations: dict[int, int] = field(default_factory=dict)
    # every server process's TMPDIR: what a killed server (or its workers) left in its
    # temporary directory goes with the launcher's stop(), not into /tmp for good
    _scratch: Path | None = None

    def __enter__(self) -> ServerLauncher:
        self.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()

    # ------------------------------------------------------------------ start
    def start(self) -> list[str]:
        try:
            if self.mode == "thread":
                for i in range(self.num_servers):
                    self._start_thread(i)
            else:
                for i in range(self.num_servers):
                    self._start_process(i)
                self._wait_healthy()
        except BaseException:
            self.stop()
            raise
        return self.urls

    def log_path(self, i: int) -> Path:
        """Server ``i``'s log: in ``log_dir``, else in a private directory made for this
        launcher (0700 under the temporary directory): never a fixed shared path, where
        another user could plant a symlink or two runs would write into each other."""
        if self.log_dir is None:
            self.log_dir = Path(tempfile.mkdtemp(prefix="relayrl-servers-"))
        return self.log_dir / f"server-{i}.log"

    def scratch_dir(self) -> Path:
        """The servers' temporary directory (0700, made on first use, removed by
        :meth:`stop`)."""
        if self._scratch is None:
            self._scratch = Path(tempfile.mkdtemp(prefix="relayrl-server-tmp-"))
        return self._scratch

    def _command(self, port: int) -> list[str]:
        """A server's command line: the same for every server (it carries no key)."""
        return self.spec.command(port)

    def key_of(self, i: int) -> str | None:
        """The key of server ``i`` as it runs now: ``server_key(run key, i, incarnation)``;
        None when the spec has no key (its servers have none)."""
        run_key = getattr(self.spec, "api_key", None)
        if not run_key:
            return None
        return server_key(run_key, i, self._incarnations.get(i, 0))

    def spec_for(self, i: int) -> Any:
        """The spec server ``i`` is started with: the launcher's, holding :meth:`key_of`
        ``(i)`` instead of the run key."""
        key = self.key_of(i)
        return self.spec if key is None else replace(self.spec, api_key=key)

    def url_keys(self) -> dict[str, str]:
        """Each keyed server's URL and the key its client sends it."""
        keys = {url: self.key_of(i) for i, url in enumerate(self.urls)}
        return {url: key for url, key in keys.items() if key is not None}

    def client_keys(self) -> dict[str, Any]:
        """The keys a client of these servers is built with (``RolloutClient(urls,
        **launcher.client_keys())``): each server's own (:meth:`url_keys`, none for any
        other URL) and the transfer groups' secret; ``{}`` when the servers have no key."""
        run_key = getattr(self.spec, "api_key", None)
        if not run_key:
            return {}
        secret = transfer_secret(run_key)
        return {"api_key": None, "server_keys": self.url_keys(), "transfer_secret": secret}

    def _listen(self, i: int) -> socket.socket:
        """Server ``i``'s listening socket: on ``spec.port + i`` (RelayError if taken), else
        on a free port."""
        host = self.spec.host
        if self.spec.port is None:
            return reserve_port(host, None)
        port = self.spec.port + i
        try:
            return reserve_port(host, port)
        except OSError:
            raise RelayError(
                f"rollout server {i}: port {port} on {host} is in use (the {self.spec.kind} "
                f"server's port is the configured first port {self.spec.port} + {i}); free it "
                "or choose another port"
            ) from None

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
        sock = self._listen(i)
        try:
            proc, log, url = self._popen_on(i, log_mode, sock)
        except BaseException:
            sock.close()
            raise
        self._held.append((proc, sock))
        self._watch_exits()
        return proc, log, url

    def _popen_on(
        self, i: int, log_mode: str, sock: socket.socket
    ) -> tuple[subprocess.Popen, Path, str]:
        """Server ``i``'s process, inheriting ``sock`` (its number in ``LISTEN_FD_ENV``)."""
        host, port = sock.getsockname()[:2]
        log = self.log_path(i)
        log.parent.mkdir(parents=True, exist_ok=True)
        env = dict(os.environ, **self.spec_for(i).environment(i))  # its own key
        env[PARENT_ENV] = str(os.getpid())
        env[LISTEN_FD_ENV] = str(sock.fileno())
        env["TMPDIR"] = str(self.scratch_dir())
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
                start_new_session=self.spec.new_session,
                pass_fds=(sock.fileno(),),
            )
        return proc, log, f"http://{f'[{host}]' if ':' in host else host}:{port}"

    def _watch_exits(self) -> None:
        """Start the thread that unlistens the socket of every server process that exits
        (until :meth:`stop`): its port stays this run's, connections to it are refused."""
        if self._watcher is None:
            self._stopping.clear()
            self._watcher = threading.Thread(
                target=self._unlisten_exited, name="relayrl-server-ports", daemon=True
            )
            self._watcher.start()

    def _unlisten_exited(self) -> None:
        done: set[int] = set()
        while not self._stopping.wait(0.1):
            for proc, sock in list(self._held):
                if proc.pid not in done and proc.poll() is not None:
                    unlisten(sock)
                    done.add(proc.pid)

    def _health(self, i: int) -> str:
        """Server ``i``'s :func:`health_state`; a keyed server must prove it holds its key."""
        return health_state(self.urls[i], self.key_of(i))

    def _wait_healthy(self, indices: list[int] | None = None) -> None:
        deadline = time.monotonic() + self.startup_timeout_s
        waiting = set(range(len(self._procs)) if indices is None else indices)
        while waiting:
            self.check()
            states = {i: self._health(i) for i in waiting}
            for i, state in states.items():
                if state == UNPROVEN:
                    raise RelayError(
                        self.describe(
                            i,
                            "answered GET /health without proving that it holds its key: "
                            "another process is listening on its port (the key was not sent "
                            "to it)",
                        )
                    )
            waiting = {i for i, state in states.items() if state != UP}
            if waiting and time.monotonic() > deadline:
                i = min(waiting)
                raise RelayError(
                    self.describe(
                        i,
                        f"did not become healthy within {self.startup_timeout_s:.0f}s "
                        "(rollout.startup_timeout_s)",
                    )
                )
            if waiting:
                time.sleep(0.2)

    def _start_thread(self, i: int) -> None:
        from relayrl.engine.engine import Engine
        from relayrl.engine.server import ServerThread, create_app

        if not isinstance(self.spec, ServerSpec):
            raise RelayError(
                f"rollout.server_mode=thread runs only the built-in engine, not {self.spec.kind}"
            )
        engine = Engine.from_pretrained(self.spec.model_dir, self.spec.engine_options())
        server = ServerThread(create_app(engine, self.key_of(i))).start()
        self._threads.append((server, engine))
        self.urls.append(server.url)

    # ------------------------------------------------------------------ replace one
    @property
    def is_process_mode(self) -> bool:
        return self.mode != "thread"

    def index_of(self, url: str) -> int:
        return index_of(self.urls, url)

    def exit_code(self, i: int) -> int | None:
        """Server ``i``'s exit status, or None while it runs (thread servers: always None)."""
        return self._procs[i].poll() if self.is_process_mode else None

    def kill(self, i: int) -> None:
        """SIGKILL server ``i`` (a hung one; a stopped process dies too) and reap it, so its
        connections break at once and :meth:`exit_code` reports it."""
        if not self.is_process_mode:
            return
        proc = self._procs[i]
        if proc.poll() is None or self.spec.new_session:
            self._signal(proc, signal.SIGKILL)
        with contextlib.suppress(subprocess.TimeoutExpired):
            proc.wait(timeout=10)

    def respawn(self, i: int) -> str:
        """Replace server ``i`` (killed first if still running) by a fresh process on a new
        port, its output appended to the same log, holding a key of its own (the next
        incarnation's, :meth:`key_of`); returns its URL, not yet healthy (see
        :meth:`wait_healthy`). Safe from any thread: the spawner thread forks it."""
        self._incarnations[i] = self._incarnations.get(i, 0) + 1
        if not self.is_process_mode:
            server, engine = self._threads[i]
            server.stop()
            engine.shutdown()
            self._threads.pop(i)
            self._start_thread(i)
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

    def _signal(self, proc: subprocess.Popen, sig: int) -> None:
        """Send ``sig`` to a server: to its whole process group if it has one of its own
        (whose children may outlive it), else to the process."""
        with contextlib.suppress(OSError):
            if self.spec.new_session:
                os.killpg(proc.pid, sig)
            elif proc.poll() is None:
                proc.send_signal(sig)

    def check(self) -> None:
        """Raise a RelayError naming the first server process that has exited."""
        for i, proc in enumerate(self._procs):
            code = proc.poll()
            if code is not None:
                raise RelayError(self.describe(i, f"exited with code {code}"))

    def node_of(self, i: int) -> str:
        return "local"

    def describe(self, i: int, what: str, consequence: str = "the run cannot continue") -> str:
        """``rollout server i (url, pid) <what>; <consequence> (log: ...); last output: ...``"""
        if not self.is_process_mode:
            return f"rollout server {i} ({self.urls[i]}, in-process) {what}; {consequence}"
        line = telling_line(self._logs[i])
        tail = f"; last output: {line}" if line else ""
        return (
            f"rollout server {i} ({self.urls[i]}, pid {self._procs[i].pid}) {what}; "
            f"{consequence} (log: {self._logs[i]}){tail}"
        )

    def _wait_group_gone(self, pgid: int, deadline: float) -> None:
        """Until process group ``pgid`` is empty; SIGKILL it past ``deadline`` and give up
        5 s later (what is left then are zombies waiting for a reaper)."""
        killed = False
        while True:
            try:
                os.killpg(pgid, 0)
            except OSError:
                return
            if time.monotonic() > deadline:
                if killed:
                    return
                with contextlib.suppress(OSError):
                    os.killpg(pgid, signal.SIGKILL)
                killed, deadline = True, time.monotonic() + 5
            time.sleep(0.1)

    def _release_ports(self) -> None:
        """Stop the exit watcher and close every server's socket (their ports are free)."""
        self._stopping.set()
        if self._watcher is not None:
            self._watcher.join(timeout=5)
            self._watcher = None
        for _, sock in self._held:
            unlisten(sock)
            sock.close()
        self._held.clear()

    def stop(self) -> None:
        for proc in self._procs:
            if proc.poll() is None or self.spec.new_session:
                self._signal(proc, signal.SIGTERM)
                self._signal(proc, signal.SIGCONT)  # a stopped (hung) server exits too
        deadline = time.monotonic() + 10
        for proc in self._procs:
            try:
                proc.wait(timeout=max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                self._signal(proc, signal.SIGKILL)
                proc.wait(timeout=5)
        if self.spec.new_session:  # grandchildren that outlived their group leader
            for proc in self._procs:
                self._wait_group_gone(proc.pid, deadline)
        self._procs.clear()
        with self._spawner_lock:
            spawner, self._spawner = self._spawner, None
        if spawner is not None:  # after the children are gone: its exit is their parent death
            spawner.shutdown(wait=True)
        self._release_ports()
        for server, engine in self._threads:
            server.stop()
            engine.shutdown()
        self._threads.clear()
        if self._scratch is not None:  # after every server process is gone
            shutil.rmtree(self._scratch, ignore_errors=True)
            self._scratch = None


@dataclass
class ExternalServers:
    """Servers someone else started (``rollout.server_urls``, ``relayrl eval --server-url``,
    a ``distill.teacher`` URL) behind the launcher's interface: :meth:`start` waits until
    each answers ``/health`` and, when the client has a key, proves that it holds it
    (:func:`health_state`) before the client sends that key anywhere; none is started,
    stopped, killed or restarted."""

    urls: list[str]
    startup_timeout_s: float = 120.0
    # the key the client will send them; None: no key, nothing to prove
    api_key: str | None = field(default=None, repr=False)
    origin: str = "rollout.server_urls"  # where the URLs were given, for error messages
    listed: bool = True  # ``origin`` is a list (``origin[i]`` in messages), not one URL
    key_origin: str = "rollout.api_key / $RELAYRL_API_KEY / $RELAYRL_API_KEY_FILE"

    def __enter__(self) -> ExternalServers:
        self.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()

    def start(self) -> list[str]:
        """Wait for every server (RelayError naming the URL after ``startup_timeout_s``, at
        once for one that answers without the proof of the key)."""
        deadline = time.monotonic() + self.startup_timeout_s
        for i, url in enumerate(self.urls):
            while (state := health_state(url, self.api_key)) != UP:
                if state == UNPROVEN:
                    raise RelayError(self._unproven(i))
                if time.monotonic() > deadline:
                    within = (
                        f" within {self.startup_timeout_s:.0f}s (rollout.startup_timeout_s)"
                        if self.startup_timeout_s
                        else ""
                    )
                    raise RelayError(
                        f"{self._where(i)}: {url} did not answer GET /health{within}; is it "
                        "running and reachable?"
                    )
                time.sleep(0.2)
        return self.urls

    def _where(self, i: int) -> str:
        """Where URL ``i`` was given: ``rollout.server_urls[0]``, ``distill.teacher``."""
        return f"{self.origin}[{i}]" if self.listed else self.origin

    def _unproven(self, i: int) -> str:
        url = self.urls[i]
        port = url_port(url)
        return (
            f"{self._where(i)}: {url} answered GET /health without proving that it holds "
            f"the key; expected its {PROOF_HEADER} header to be HMAC-SHA256(key, "
            f"'relayrl-health {port} <challenge>') from a server started with the key of "
            f"{self.key_origin} (`relayrl serve`, or vLLM with relayrl_vllm_guard) and "
            f"listening on port {port} itself (not behind a port forward or proxy on another "
            "port). Another process may be listening there; the key was not sent to it "
            "(docs/security.md)"
        )

    is_process_mode = False
    pids: list[int] = field(default_factory=list)

    def index_of(self, url: str) -> int:
        return index_of(self.urls, url)

    def key_of(self, i: int) -> str | None:
        """The one key the user gave for every server they started (none is restarted)."""
        return self.api_key

    def exit_code(self, i: int) -> int | None:
        return None

    def kill(self, i: int) -> None:
        return None

    def respawn(self, i: int) -> str:
        raise RelayError(self.describe(i, "cannot be restarted by relayrl"))

    def wait_healthy(self, indices: list[int]) -> None:
        return None

    def check(self) -> None:
        return None

    def describe(self, i: int, what: str, consequence: str = "the run cannot continue") -> str:
        return f"rollout server {i} ({self.urls[i]}, external) {what}; {consequence}"

    def node_of(self, i: int) -> str:
        return urlsplit(self.urls[i]).hostname or self.urls[i]

    def stop(self) -> None:
        return None
