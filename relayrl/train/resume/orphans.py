"""Clean-up after runs that could not clean up: directories of processes that are gone.

Owns: :func:`remove_orphaned_dirs`. A run publishes weights into ``<prefix><pid>-<8 chars>``
directories (``tempfile.mkdtemp``) and removes them when it ends; one killed with SIGKILL
cannot, so the next run removes every such directory whose process ``<pid>`` no longer exists.
Left alone: a live process's (or another user's) directory, files, and names of any other
shape (e.g. those of a run whose name extends this one's prefix).

Imports: nothing of relayrl.
"""

from __future__ import annotations

import os
import re
import shutil
import stat
from pathlib import Path

MKDTEMP_SUFFIX = r"-[a-z0-9_]{8}"  # tempfile.mkdtemp's random part, after ``<pid>``


def remove_orphaned_dirs(base: Path, prefix: str) -> list[Path]:
    """Remove ``base/<prefix><pid>-*`` directories whose process is gone (a run killed with
    -9 cannot clean up its published weights) and that this user created (a shared ``/dev/shm``
    holds other users' runs: root could delete them); returns the removed paths."""
    shape = re.compile(re.escape(prefix) + r"(\d+)" + MKDTEMP_SUFFIX)
    removed = []
    for path in sorted(base.glob(f"{prefix}*")):
        match = shape.fullmatch(path.name)
        if match and _ours(path) and not _alive(int(match.group(1))):
            shutil.rmtree(path, ignore_errors=True)
            removed.append(path)
    return removed


def _ours(path: Path) -> bool:
    """A real directory (not a link) owned by this process's user."""
    try:
        info = path.lstat()
    except OSError:
        return False
    return stat.S_ISDIR(info.st_mode) and info.st_uid == os.geteuid()


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True
