"""The secrets of a run: the control-plane API key and the checkpoint key (docs/security.md).

Owns: :data:`API_KEY_ENV` / :data:`API_KEY_FILE_ENV` (how a key reaches a server or a client
without a command line: ``/proc/<pid>/cmdline`` is readable by every user, the environment
and a 0600 file are not), :func:`new_key`, :func:`key_from_env`, :func:`read_key_file` (which
refuses a file other users could read or that someone else owns), :func:`run_key` (the
per-run-directory secret ``<run>/run.key``, created 0600 on first use), :func:`derive`
(one independent subkey per purpose, so that a leaked subkey reveals nothing of the key it
was derived from nor of its siblings), the two subkeys of a run key a run uses,
:func:`server_key` (each launched server's own key, a new one for each restart) and
:func:`transfer_secret` (the weight-transfer groups' rendezvous secret, which no server is
started with), and :func:`health_proof` (how a server shows that it holds the key
without the client sending it: the answer to a ``GET /health`` challenge, bound to the port
the server listens on, so that a process squatting one port cannot relay another server's
answer; ``relayrl/launch/vllm_worker/relayrl_vllm_guard.py`` computes the same).

Imports: relayrl.errors, the standard library.
"""

from __future__ import annotations

import hashlib
import hmac
import os
import secrets
import stat
from pathlib import Path

from relayrl.errors import RelayError

API_KEY_ENV = "RELAYRL_API_KEY"
API_KEY_FILE_ENV = "RELAYRL_API_KEY_FILE"
RUN_KEY_FILE = "run.key"


def new_key() -> str:
    """A fresh random key (256 bits, URL-safe text)."""
    return secrets.token_urlsafe(32)


def read_key_file(path: str | Path, what: str) -> str:
    """The key stored in ``path``: RelayError naming ``what`` if the file is missing, empty,
    owned by another user or readable by group/others (``chmod 600`` it)."""
    p = Path(path)
    try:
        info = p.stat()
        text = p.read_text().strip()
    except OSError as exc:
        raise RelayError(f"{what}: cannot read key file {p}: {exc.strerror or exc}") from None
    if info.st_uid != os.getuid():
        raise RelayError(f"{what}: key file {p} belongs to uid {info.st_uid}, not to this user")
    if info.st_mode & (stat.S_IRWXG | stat.S_IRWXO):
        raise RelayError(
            f"{what}: key file {p} is accessible to other users "
            f"(mode {stat.S_IMODE(info.st_mode):o}); run `chmod 600 {p}`"
        )
    if not text:
        raise RelayError(f"{what}: key file {p} is empty")
    return text


def key_from_env() -> str | None:
    """``$RELAYRL_API_KEY``, else the contents of ``$RELAYRL_API_KEY_FILE``, else None."""
    key = os.environ.get(API_KEY_ENV)
    if key:
        return key
    path = os.environ.get(API_KEY_FILE_ENV)
    return read_key_file(path, API_KEY_FILE_ENV) if path else None


def write_key_file(path: Path, key: str) -> None:
    """Create ``path`` holding ``key``, mode 0600 from the start (never world-readable)."""
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    with os.fdopen(fd, "w") as f:
        f.write(key + "\n")
        f.flush()
        os.fsync(f.fileno())


def run_key(run_dir: Path) -> str:
    """The secret of the run in ``run_dir`` (``run.key``, created 0600 on first use)."""
    path = Path(run_dir) / RUN_KEY_FILE
    if not path.exists():
        try:
            write_key_file(path, new_key())
        except FileExistsError:
            pass  # another process of this run created it first
        except OSError as exc:
            raise RelayError(f"cannot create the run key {path}: {exc}") from exc
    return read_key_file(path, "run key")


def derive(key: str, *purpose: str | int) -> str:
    """An independent subkey of ``key`` for ``purpose``: HMAC-SHA256 under ``key`` of the
    purpose's parts joined by spaces, hex. Whoever holds the subkey cannot compute ``key``
    nor any other subkey of it."""
    message = " ".join(str(part) for part in purpose)
    return hmac.new(key.encode(), message.encode(), hashlib.sha256).hexdigest()


def server_key(run_key: str, index: int, incarnation: int) -> str:
    """The key of launched server ``index`` in its ``incarnation`` (0 at the run's start,
    one more at each restart): a key taken from one server opens neither the others nor
    its own restart (docs/security.md)."""
    return derive(run_key, "server", int(index), int(incarnation))


def transfer_secret(run_key: str) -> str:
    """The secret of the run's weight-transfer groups' rendezvous (``store_prefix``): the
    trainer sends it to each server in its join request; no server key opens it."""
    return derive(run_key, "weight-transfer group")


CHALLENGE_HEADER = "x-relayrl-challenge"  # GET /health: the client's fresh random challenge
PROOF_HEADER = "x-relayrl-proof"  # the server's answer, health_proof(key, port, challenge)
MAX_CHALLENGE = 128  # characters; a longer challenge gets no proof


def health_proof(key: str, port: int, challenge: str) -> str:
    """What a server holding ``key`` and listening on ``port`` answers to ``challenge``:
    HMAC-SHA256 of ``relayrl-health <port> <challenge>`` under ``key``, hex."""
    message = f"relayrl-health {int(port)} {challenge}"
    return hmac.new(key.encode(), message.encode(), hashlib.sha256).hexdigest()
