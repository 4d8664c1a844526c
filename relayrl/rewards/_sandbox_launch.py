"""Sandbox launcher: run as root-or-user ``python -I -S _sandbox_launch.py CONFIG_JSON``.

A standalone script (standard library only, no relayrl imports) that the sandbox starts in a
fresh session. It isolates itself, then ``exec``s the sandboxed command.

Stand-alone (the ``launcher`` backend):

1. new mount, network, IPC, PID and UTS namespaces (as root; otherwise inside a new user
   namespace mapping only the caller's own uid and gid). When the kernel refuses them the
   launcher prints one ``relayrl-sandbox: ...`` line to stderr and exits 125 without running
   the command, unless ``CONFIG["allow_unisolated"]`` (the documented opt-out);
2. it forks the namespace's init (pid 1: reaps, dies with the launcher, and its death kills
   every process of the run); the init builds a **new root** on a size-capped tmpfs holding
   only the read-only binds of ``CONFIG["mounts"]`` (``/usr``, ``/lib*``, the interpreter's
   prefix), a few ``/etc`` files, ``/dev/{null,zero,full,random,urandom}``, a fresh ``/proc``
   where the kernel allows it, and ``/tmp/work`` with the given files; it ``pivot_root``s
   into it and detaches the host's tree, so datasets, the project, home directories,
   ``/run`` and host sockets are not reachable by path;
3. the command runs as the init's child with resource limits (CPU seconds, address space,
   file size, open files, processes, no core), ``PR_SET_NO_NEW_PRIVS``, and — when started
   as root — no supplementary groups and the per-run uid ``CONFIG["uid"]``, which owns
   nothing on the host.

Under bubblewrap (``CONFIG["isolated"]``: bwrap already built the namespaces and the new
root) step 1-2 are skipped: the launcher copies the files from the read-only ``input``
directory into ``/tmp/work`` and goes on with step 3.

What it achieved goes to the command as ``RELAYRL_SANDBOX_NET`` (``namespace`` or ``none``)
so that the code runner can install its socket-blocking audit hook when there is no network
namespace.
"""

from __future__ import annotations

import ctypes
import json
import os
import platform
import resource
import signal
import sys

CLONE_NEWNS = 0x00020000
CLONE_NEWUTS = 0x04000000
CLONE_NEWIPC = 0x08000000
CLONE_NEWUSER = 0x10000000
CLONE_NEWPID = 0x20000000
CLONE_NEWNET = 0x40000000
MS_RDONLY = 1
MS_NOSUID = 2
MS_NODEV = 4
MS_NOEXEC = 8
MS_REMOUNT = 32
MS_BIND = 4096
MS_REC = 16384
MS_PRIVATE = 1 << 18
MNT_DETACH = 2
KEPT_FLAGS = 2 | 4 | 8 | 1024 | 2048 | 4096  # nosuid nodev noexec noatime nodiratime relatime
PR_SET_PDEATHSIG = 1
PR_SET_NO_NEW_PRIVS = 38
SYS_PIVOT_ROOT = {"x86_64": 155, "aarch64": 41, "ppc64le": 203, "s390x": 217}
SANDBOX_WORKDIR = "/tmp/work"
DEVICES = ("null", "zero", "full", "random", "urandom")
REFUSED = 125
NOT_RUN = 127

_libc = ctypes.CDLL(None, use_errno=True)


def _errno() -> str:
    return os.strerror(ctypes.get_errno())


def _mount(source: str, target: str, fstype: str | None, flags: int, data: str = "") -> None:
    result = _libc.mount(
        source.encode(), target.encode(), fstype.encode() if fstype else None, flags,
        data.encode() if data else None,
    )  # fmt: skip
    if result != 0:
        raise OSError(ctypes.get_errno(), f"mount {source} on {target}: {_errno()}")


def _read_files(directory: str) -> dict[str, bytes]:
    saved = {}
    for name in os.listdir(directory):
        with open(os.path.join(directory, name), "rb") as handle:
            saved[name] = handle.read()
    return saved


def _write_files(directory: str, files: dict[str, bytes]) -> None:
    os.mkdir(directory, 0o700)
    for name, data in files.items():
        with open(os.path.join(directory, name), "wb") as handle:
            handle.write(data)


def _write(path: str, text: str) -> None:
    with open(path, "w", encoding="ascii") as handle:
        handle.write(text)


def _unshare_all() -> str | None:
    """New mount/net/ipc/pid/uts namespaces (in a new user namespace when not root); the
    reason when the kernel refuses."""
    flags = CLONE_NEWNS | CLONE_NEWNET | CLONE_NEWIPC | CLONE_NEWPID | CLONE_NEWUTS
    if os.geteuid() == 0:
        if _libc.unshare(flags) == 0:
            return None
        return f"unshare(mount, net, ipc, pid) as root: {_errno()} (no CAP_SYS_ADMIN?)"
    uid, gid = os.getuid(), os.getgid()
    if _libc.unshare(flags | CLONE_NEWUSER) != 0:
        return (
            f"unshare(user, mount, net, ipc, pid) as uid {uid}: {_errno()} (user namespaces off?)"
        )
    try:
        _write("/proc/self/setgroups", "deny")
        _write("/proc/self/uid_map", f"{uid} {uid} 1\n")
        _write("/proc/self/gid_map", f"{gid} {gid} 1\n")
    except OSError as exc:
        return f"user namespace maps as uid {uid}: {exc.strerror}"
    return None


def _bind(source: str, target: str, read_only: bool = True) -> None:
    _mount(source, target, None, MS_BIND | MS_REC)
    if read_only:
        kept = os.statvfs(source).f_flag & KEPT_FLAGS
        _mount(source, target, None, MS_BIND | MS_REMOUNT | MS_RDONLY | kept)


def _makedirs(path: str) -> None:
    os.makedirs(path, mode=0o755, exist_ok=True)


def _populate_root(root: str, cfg: dict) -> None:
    """The new root's contents: read-only binds, symlinks, /etc files, devices, /proc."""
    for kind, source, target in cfg["mounts"]:
        inside = root + target
        if kind == "symlink":
            _makedirs(os.path.dirname(inside))
            os.symlink(source, inside)
        elif kind == "bind" and os.path.isdir(source):
            _makedirs(inside)
            _bind(source, inside)
        elif kind == "file" and os.path.isfile(source):
            _makedirs(os.path.dirname(inside))
            with open(source, "rb") as src, open(inside, "wb") as dst:
                dst.write(src.read())
            os.chmod(inside, 0o644)
    for name in ("tmp", "var/tmp", "dev/shm"):
        _makedirs(f"{root}/{name}")
        os.chmod(f"{root}/{name}", 0o1777)
    for name in DEVICES:
        open(f"{root}/dev/{name}", "wb").close()
        _bind(f"/dev/{name}", f"{root}/dev/{name}", read_only=False)
    for name, target in (("fd", "/proc/self/fd"), ("stdin", "/proc/self/fd/0"),
                         ("stdout", "/proc/self/fd/1"), ("stderr", "/proc/self/fd/2")):  # fmt: skip
        os.symlink(target, f"{root}/dev/{name}")
    _makedirs(f"{root}/proc")
    try:  # a fresh /proc shows this pid namespace only; a container may refuse it
        _mount("proc", f"{root}/proc", "proc", MS_NOSUID | MS_NODEV | MS_NOEXEC)
    except OSError:
        pass


def _enter_root(root: str) -> None:
    """``pivot_root`` into ``root`` and detach the host's tree (``chroot`` if the
    architecture's syscall number is unknown or the kernel refuses)."""
    os.chdir(root)
    number = SYS_PIVOT_ROOT.get(platform.machine())
    if number is not None and _libc.syscall(number, b".", b".") == 0:
        _libc.umount2(b".", MNT_DETACH)
    else:
        os.chroot(".")
    os.chdir("/")


def _build_root(cfg: dict, files: dict[str, bytes]) -> None:
    _mount("none", "/", None, MS_REC | MS_PRIVATE)
    root = cfg["root"]
    _mount("tmpfs", root, "tmpfs", MS_NOSUID | MS_NODEV, f"size={int(cfg['disk_mb'])}m,mode=755")
    _populate_root(root, cfg)
    _enter_root(root)
    _write_files(SANDBOX_WORKDIR, files)
    os.chdir(SANDBOX_WORKDIR)


def _limits(cfg: dict) -> None:
    def set_limit(kind: int, value: int) -> None:
        resource.setrlimit(kind, (value, value))

    set_limit(resource.RLIMIT_CORE, 0)
    set_limit(resource.RLIMIT_CPU, int(cfg["cpu_s"]))
    set_limit(resource.RLIMIT_AS, int(cfg["process_memory_bytes"]))
    set_limit(resource.RLIMIT_FSIZE, int(cfg["file_bytes"]))
    set_limit(resource.RLIMIT_NOFILE, int(cfg["nofile"]))
    set_limit(resource.RLIMIT_NPROC, int(cfg["nproc"]))


def _exec_command(cfg: dict, net: bool) -> None:
    """Limits, no-new-privs, the run's uid; then exec the command (never returns)."""
    uid = cfg.get("uid")
    if uid is not None and os.geteuid() == 0:
        os.chown(".", uid, uid)
        for name in os.listdir("."):
            os.chown(name, uid, uid)
    _libc.prctl(PR_SET_NO_NEW_PRIVS, 1, 0, 0, 0)
    _limits(cfg)
    if uid is not None and os.geteuid() == 0:
        os.setgroups([])
        os.setgid(uid)
        os.setuid(uid)
    env = dict(cfg["env"])
    env["RELAYRL_SANDBOX_NET"] = "namespace" if net else "none"
    argv = cfg["argv"]
    os.execve(argv[0], argv, env)


def _exit_like(status: int) -> None:
    code = os.waitstatus_to_exitcode(status)
    os._exit(code if code >= 0 else 128 - code)


def _init(cfg: dict, files: dict[str, bytes]) -> None:
    """pid 1 of the run's namespace: build the root, start the command, reap until it ends
    (its exit, or this process's death, ends every process of the namespace)."""
    _libc.prctl(PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)
    try:
        _build_root(cfg, files)
    except OSError as exc:
        print(f"relayrl-sandbox: cannot build the sandbox root: {exc}", file=sys.stderr)
        os._exit(REFUSED)
    command = os.fork()
    if command == 0:
        try:
            _exec_command(cfg, net=True)
        except OSError as exc:
            print(f"relayrl-sandbox: cannot run {cfg['argv'][0]}: {exc}", file=sys.stderr)
        finally:
            os._exit(NOT_RUN)
    while True:
        pid, status = os.wait()
        if pid == command:
            _exit_like(status)


def _isolated_run(cfg: dict, files: dict[str, bytes]) -> None:
    _libc.prctl(PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)  # after unshare changed our creds
    if os.getppid() == 1:
        os._exit(REFUSED)
    child = os.fork()
    if child == 0:
        try:
            _init(cfg, files)
        finally:
            os._exit(REFUSED)
    _, status = os.waitpid(child, 0)
    _exit_like(status)


def main() -> None:
    cfg = json.loads(sys.argv[1])
    workdir = cfg["workdir"]
    if cfg.get("isolated"):  # bubblewrap made the namespaces and the new root
        files = _read_files(workdir)
        _write_files(SANDBOX_WORKDIR, files)
        os.chdir(SANDBOX_WORKDIR)
        _exec_command(cfg, net=True)
    files = _read_files(workdir)
    refused = _unshare_all()
    if refused is None:
        _isolated_run(cfg, files)
    if not cfg.get("allow_unisolated"):
        print(f"relayrl-sandbox: no isolation: {refused}", file=sys.stderr)
        sys.exit(REFUSED)
    os.chdir(workdir)  # the opt-out: limits and the run's uid only, on the host's tree
    _exec_command(cfg, net=False)


if __name__ == "__main__":
    main()
