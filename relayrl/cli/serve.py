"""``relayrl serve``: run a rollout server (built-in engine + SGLang-style HTTP API)."""

from __future__ import annotations

import argparse

from relayrl.errors import RelayError

HELP = "serve a model with the built-in engine over an SGLang-style HTTP API"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--model",
        required=True,
        help="Hugging Face model directory, a .gguf file or pkg:PACKAGE (converted once)",
    )
    parser.add_argument("--host", default="127.0.0.1", help="bind address (default 127.0.0.1)")
    parser.add_argument("--port", type=int, default=30000)
    parser.add_argument(
        "--api-key-file",
        default=None,
        help="require 'Authorization: Bearer KEY' with KEY read from this 0600 file (default: "
        "$RELAYRL_API_KEY, else $RELAYRL_API_KEY_FILE); mandatory for a non-loopback --host. "
        "Never on the command line: other users can read it in ps",
    )
    parser.add_argument("--threads", type=int, default=1, help="torch threads (default 1)")
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--dtype", default="float32")
    parser.add_argument("--max-running-requests", type=int, default=64)
    parser.add_argument("--max-total-tokens", type=int, default=None)
    parser.add_argument("--max-seq-len", type=int, default=None)
    parser.add_argument("--weight-version", type=int, default=0)
    parser.add_argument(
        "--max-adapters",
        type=int,
        default=1,
        help="LoRA adapter versions kept and served at once: 1 merges each adapter "
        "publication into the weights; K >= 2 lets every request finish under the adapter of "
        "the version it started with (docs/lora.md)",
    )
    parser.add_argument(
        "--access-log", action="store_true", help="log every HTTP request (default off)"
    )
    parser.add_argument(
        "--open-control-plane",
        action="store_true",
        help="without a key, let anyone who reaches the server load weights into it, pause "
        "it and join transfer groups (loopback hosts only); by default a keyless server "
        "answers those routes with 403 and serves generation only (docs/security.md)",
    )


def _api_key(path: str | None) -> str | None:
    from relayrl.runkey import key_from_env, read_key_file

    return read_key_file(path, "--api-key-file") if path else key_from_env()


def run(args: argparse.Namespace) -> int:
    from relayrl.engine.serve import ServeOptions, serve_main
    from relayrl.engine.types import EngineOptions
    from relayrl.models.gguf import resolve_model_path

    try:
        engine = EngineOptions(
            device=args.device,
            dtype=args.dtype,
            max_running_requests=args.max_running_requests,
            max_total_tokens=args.max_total_tokens,
            max_seq_len=args.max_seq_len,
            weight_version=args.weight_version,
            max_adapters=args.max_adapters,
        )
    except ValueError as exc:
        raise RelayError(str(exc)) from exc
    options = ServeOptions(
        model=resolve_model_path(args.model, key="--model"),
        host=args.host,
        port=args.port,
        api_key=_api_key(args.api_key_file),
        threads=args.threads,
        access_log=args.access_log,
        engine=engine,
        open_control_plane=args.open_control_plane,
    )
    return serve_main(options)
