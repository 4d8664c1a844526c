"""Clean-up after runs that could not clean up: directories of processes that are gone.

Owns: :func:`remove_orphaned_dirs`. A run publishes weights into ``<prefix><pid>-*``
directories and removes them when it ends; one killed with SIGKILL cannot, so the next run
removes every such directory whose process ``<pid>`` no longer exists (a live process, or
one of another user, is left alone).

Imports: nothing of relayrl.
"""

from __future__ import annotations

import os
import shutil
from pathlib import Path


def remove_orphaned_dirs(base: Path, prefix: str) -> list[Path]:
    """Remove ``base/<prefix><pid>-*`` directories whose process is gone (a run killed with
    -9 cannot clean up its published weights); returns the removed paths."""
    removed = []
    for path in base.glob(f"{prefix}*"):
        pid = path.name[len(prefix) :].split("-", 1)[0]
        if pid.isdigit() and not _alive(int(pid)):
            shutil.rmtree(path, ignore_errors=True)
            removed.append(path)
    return removed


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True
