"""Run one built-in rollout server in the foreground: :func:`serve_main`.

Owns: :class:`ServeOptions` (what a server process needs: model directory, bind address or
an inherited listening socket, API key, whether a keyless server's control plane is open,
torch threads, access log, and the :class:`EngineOptions`) and :func:`serve_main`,
the one entry point that both ``relayrl serve`` (from its argv) and the run launcher (from a
JSON copy of the options, :meth:`ServeOptions.to_json`, and the API key in its environment)
call; neither goes through the other. :func:`check_generates` keeps a server whose engine
cannot generate from starting.
"""

from __future__ import annotations

import json
import sys
from dataclasses import asdict, dataclass, field

from relayrl.engine.types import EngineOptions
from relayrl.errors import RelayError


@dataclass
class ServeOptions:
    model: str
    host: str = "127.0.0.1"
    port: int = 30000
    api_key: str | None = None
    threads: int = 1
    access_log: bool = False
    engine: EngineOptions = field(default_factory=EngineOptions)
    # without a key: weight loads, pauses and transfer groups answer 403 unless this is set
    # (loopback only; docs/security.md)
    open_control_plane: bool = False
    # a listening socket inherited from the launcher (its fd number), served instead of
    # binding host:port; set from the environment by relayrl.launch.servers.serve_child
    listen_fd: int | None = None

    def to_json(self) -> str:
        """The options as JSON for a child's command line: without the API key, which
        travels in the child's environment (``RELAYRL_API_KEY``; argv is public)."""
        return json.dumps({**asdict(self), "api_key": None})

    @classmethod
    def from_json(cls, text: str) -> ServeOptions:
        data = json.loads(text)
        return cls(**{**data, "engine": EngineOptions(**data.get("engine", {}))})


def _warn_open(options: ServeOptions) -> None:
    """A keyless server says what any local user can do with it."""
    if options.open_control_plane:
        what = "load weights into it, pause it or generate"
    else:
        what = "generate (weight loads and pauses answer 403: the control plane is closed)"
    print(
        f"warning: serving on {options.host} without an API key: any local user can {what}; "
        "set RELAYRL_API_KEY or --api-key-file (docs/security.md)",
        file=sys.stderr,
        flush=True,
    )


def check_generates(engine) -> None:
    """Refuse to serve an engine that cannot generate: one greedy generation of two tokens
    from a one-token prompt (a prefill and a decode step, where the KV cache is allocated)
    before the port is served. A server whose every request failed (500) answered
    ``/health`` with ok; now it does not start, with one error line."""
    from relayrl.engine.types import SamplingParams

    budget = engine.kv_budget_tokens or 3
    new_tokens = max(1, min(2, engine.max_seq_len - 1, budget - 1))
    params = SamplingParams(max_new_tokens=new_tokens, temperature=0, ignore_eos=True)
    try:
        engine.generate_batch([[0]], params)
    except Exception as exc:  # noqa: BLE001 - whatever the model raised, reported whole
        error = " ".join(f"{type(exc).__name__}: {exc}".split())  # one line
        raise RelayError(
            f"{engine.model_path}: the engine failed its first generation, so nothing is "
            f"served ({error})"
        ) from exc


def serve_main(options: ServeOptions) -> int:
    """Load ``options.model`` into an :class:`Engine` and serve it until interrupted."""
    import socket

    from relayrl.engine.server import check_bind

    check_bind(options.host, options.api_key, options.open_control_plane)  # before loading
    if not options.api_key:
        _warn_open(options)
    if options.threads < 1:
        raise RelayError("--threads must be >= 1")
    import torch

    from relayrl.engine.engine import Engine
    from relayrl.engine.server import serve
    from relayrl.heap import bound_kernel_caches

    sock = None
    if options.listen_fd is not None:
        sock = socket.socket(fileno=options.listen_fd)
        sock.set_inheritable(False)  # no process this one starts gets the port
    torch.set_num_threads(options.threads)
    bound_kernel_caches()  # a server started by Ray or Slurm, not by relayrl's CLI
    engine = Engine.from_pretrained(options.model, options.engine)
    try:
        check_generates(engine)
        serve(
            engine,
            options.host,
            options.port,
            options.api_key,
            access_log=options.access_log,
            open_control_plane=options.open_control_plane,
            sock=sock,
        )
    finally:
        engine.shutdown()
    return 0
