"""``relayrl inspect RUN_DIR [--serve [--port P]]``: the rollout inspector of a run
(``relayrl.report.inspect``), a static page written into the run directory, or served on
loopback and re-built on every request while a run is live."""

from __future__ import annotations

import argparse

HELP = (
    "write RUN_DIR/report/inspect.html to browse the run's GRPO groups step by step, tokens "
    "coloured by weight version (--serve: on loopback, re-built on every reload)"
)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("run_dir", help="a run directory holding samples.jsonl / inspect.jsonl")
    parser.add_argument(
        "--serve",
        action="store_true",
        help="serve the page on 127.0.0.1 behind a random key until Ctrl-C",
    )
    parser.add_argument("--port", type=int, default=0, help="--serve's port (0: any free one)")


def run(args: argparse.Namespace) -> int:
    from relayrl.report.inspect import build_inspector, serve

    page = build_inspector(args.run_dir)
    print(f"inspect: {page}")
    if args.serve:
        server, url = serve(args.run_dir, args.port)
        print(f"serving: {url}", flush=True)
        try:
            server.serve_forever()
        except KeyboardInterrupt:
            pass
        finally:
            server.server_close()
    return 0
