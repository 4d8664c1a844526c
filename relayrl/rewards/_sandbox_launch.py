"""Sandbox launcher: run as root-or-user ``python -I -S _sandbox_launch.py CONFIG_JSON``.

A standalone script (standard library only, no relayrl imports) that the sandbox starts in a
fresh session. It isolates itself, then ``exec``s the sandboxed command, so the command runs
in this very process with everything below already in force:

1. new network namespace (no interfaces but a down loopback) and mount namespace, where
   the kernel allows it; in the mount namespace ``/tmp`` becomes a private size-capped tmpfs
   holding the working directory ``/tmp/work`` (the given files copied in), and ``/var/tmp``
   and ``/dev/shm`` private tiny ones, so nothing written there reaches the host;
2. resource limits: CPU seconds, address space, file size, open files, processes, no core;
3. ``PR_SET_NO_NEW_PRIVS`` (setuid binaries cannot regain root);
4. when started as root: every supplementary group dropped and uid/gid switched to a
   per-run uid (``base_uid + pid``), which owns nothing on the host, so RLIMIT_NPROC (ignored
   for root) applies and the parent can kill every process of the run by uid.

The launcher prints nothing; what it achieved goes to the child as ``RELAYRL_SANDBOX_NET``
(``namespace`` or ``none``) so that the runner can install its socket-blocking audit hook.

Under bubblewrap (``CONFIG["isolated"]``: bwrap already made the namespaces, a read-only
root and a size-capped private ``/tmp``) step 1 is skipped: the launcher copies the given
files from the read-only ``input`` directory into ``/tmp/work`` and goes on with 2–4, using
the uid the parent chose (``CONFIG["uid"]``: inside bwrap's pid namespace its own pid is not
unique on the host).
"""

from __future__ import annotations

import ctypes
import json
import os
import resource
import sys

CLONE_NEWNS = 0x00020000
CLONE_NEWNET = 0x40000000
CLONE_NEWUSER = 0x10000000
MS_REC = 16384
MS_PRIVATE = 1 << 18
MS_NOSUID = 2
MS_NODEV = 4
PR_SET_NO_NEW_PRIVS = 38
SANDBOX_WORKDIR = "/tmp/work"

_libc = ctypes.CDLL(None, use_errno=True)


def _unshare(flags: int) -> bool:
    return _libc.unshare(flags) == 0


def _mount_tmpfs(target: str, options: str) -> bool:
    flags = MS_NOSUID | MS_NODEV
    return _libc.mount(b"tmpfs", target.encode(), b"tmpfs", flags, options.encode()) == 0


def _private_mounts(workdir: str, disk_mb: int) -> bool:
    """Private, size-capped ``/tmp`` (host temp dirs hidden) holding the working directory
    ``/tmp/work`` with the files carried over; the caller must chdir there."""
    if _libc.mount(b"none", b"/", None, MS_REC | MS_PRIVATE, None) != 0:
        return False
    saved = {}
    for name in os.listdir(workdir):
        with open(os.path.join(workdir, name), "rb") as handle:
            saved[name] = handle.read()
    if not _mount_tmpfs("/tmp", f"size={disk_mb}m,mode=1777"):
        return False
    for other in ("/var/tmp", "/dev/shm"):
        if os.path.isdir(other):
            _mount_tmpfs(other, "size=1m,mode=1777")
    os.mkdir(SANDBOX_WORKDIR, 0o700)
    for name, data in saved.items():
        with open(os.path.join(SANDBOX_WORKDIR, name), "wb") as handle:
            handle.write(data)
    return True


def _chown_tree(path: str, uid: int) -> None:
    os.chown(path, uid, uid)
    for name in os.listdir(path):
        os.chown(os.path.join(path, name), uid, uid)


def _limits(cfg: dict) -> None:
    def set_limit(kind: int, value: int) -> None:
        resource.setrlimit(kind, (value, value))

    set_limit(resource.RLIMIT_CORE, 0)
    set_limit(resource.RLIMIT_CPU, int(cfg["cpu_s"]))
    set_limit(resource.RLIMIT_AS, int(cfg["memory_mb"]) << 20)
    set_limit(resource.RLIMIT_FSIZE, int(cfg["file_bytes"]))
    set_limit(resource.RLIMIT_NOFILE, int(cfg["nofile"]))
    set_limit(resource.RLIMIT_NPROC, int(cfg["nproc"]))


def _copy_in(source: str, target: str) -> None:
    os.mkdir(target, 0o700)
    for name in os.listdir(source):
        with open(os.path.join(source, name), "rb") as src:
            data = src.read()
        with open(os.path.join(target, name), "wb") as dst:
            dst.write(data)


def main() -> None:
    cfg = json.loads(sys.argv[1])
    workdir = cfg["workdir"]
    os.chdir(workdir)
    is_root = os.geteuid() == 0
    uid = None
    if is_root:
        uid = int(cfg["uid"]) if cfg.get("uid") is not None else int(cfg["base_uid"]) + os.getpid()
    if cfg.get("isolated"):  # bubblewrap made the namespaces and the private /tmp
        net = True
        _copy_in(workdir, SANDBOX_WORKDIR)
        os.chdir(SANDBOX_WORKDIR)
    else:
        if not is_root:
            _unshare(CLONE_NEWUSER)  # lets an unprivileged user make the namespaces below
        net = _unshare(CLONE_NEWNET)
        if _unshare(CLONE_NEWNS) and _private_mounts(workdir, int(cfg["disk_mb"])):
            os.chdir(SANDBOX_WORKDIR)
    if uid is not None:
        _chown_tree(".", uid)
    _libc.prctl(PR_SET_NO_NEW_PRIVS, 1, 0, 0, 0)
    _limits(cfg)
    if uid is not None:
        os.setgroups([])
        os.setgid(uid)
        os.setuid(uid)
    env = dict(cfg["env"])
    env["RELAYRL_SANDBOX_NET"] = "namespace" if net else "none"
    argv = cfg["argv"]
    os.execve(argv[0], argv, env)


if __name__ == "__main__":
    main()
