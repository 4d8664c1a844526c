"""Clean-up of published-weight directories left by killed runs (destructive, so checked
against what must survive): only ``<prefix><pid>-<mkdtemp suffix>`` directories of processes
that are gone go; a live process's, another run's, files and other names stay. ``weights_root``
cleans before it makes the run's own directory."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from relayrl.config.loader import load_config
from relayrl.train.resume import remove_orphaned_dirs
from relayrl.train.run.job import weights_root

PREFIX = "relayrl-run-weights-"


def dead_pid() -> int:
    """The pid of a process that has exited and been reaped."""
    proc = subprocess.Popen([sys.executable, "-c", "pass"])
    proc.wait()
    return proc.pid


def make(base: Path, name: str, file: bool = False) -> Path:
    path = base / name
    if file:
        path.write_text("x")
    else:
        path.mkdir()
        (path / "model.safetensors").write_bytes(b"w")
    return path


def test_only_directories_of_dead_processes_are_removed(tmp_path):
    gone, me = dead_pid(), os.getpid()
    orphan = make(tmp_path, f"{PREFIX}{gone}-abc_1234")
    second = make(tmp_path, f"{PREFIX}{gone}-zz99zz99")
    kept = [
        make(tmp_path, f"{PREFIX}{me}-abcd1234"),  # this process: alive
        make(tmp_path, f"{PREFIX}1-abcd1234"),  # init: alive (or not ours to signal)
        make(tmp_path, f"relayrl-other-weights-{gone}-abcd1234"),  # another run's prefix
        make(tmp_path, f"{PREFIX}{gone}-weights-{gone}-abcd1234"),  # run "run-weights-<n>"
        make(tmp_path, f"{PREFIX}{gone}-short"),  # not mkdtemp's shape
        make(tmp_path, f"{PREFIX}x{gone}-abcd1234"),  # no pid
        make(tmp_path, f"{PREFIX}{gone}-file1234", file=True),  # a file, not a directory
    ]
    assert remove_orphaned_dirs(tmp_path, PREFIX) == sorted([orphan, second])
    assert not orphan.exists() and not second.exists()
    assert all(path.exists() for path in kept)
    assert remove_orphaned_dirs(tmp_path, PREFIX) == []  # nothing left to remove


def test_weights_root_removes_orphans_then_makes_this_runs_directory(tmp_path):
    base = tmp_path / "weights"
    base.mkdir()
    orphan = make(base, f"{PREFIX}{dead_pid()}-abcd1234")
    other = make(base, f"relayrl-other-weights-{dead_pid()}-abcd1234")
    config = load_config(None, [f"output_dir={tmp_path}", "name=run", f"train.weights_dir={base}"])
    root = weights_root(config, tmp_path / "run")
    assert not orphan.exists() and other.exists()
    assert root.parent == base and root.is_dir()
    assert root.name.startswith(f"{PREFIX}{os.getpid()}-")
    assert remove_orphaned_dirs(base, PREFIX) == []  # the live run's own directory stays


def test_another_users_dead_run_directory_is_left_alone(tmp_path):
    """A shared /dev/shm holds every user's published weights: a dead-pid directory that
    another user created is theirs to remove (root deleted it before), and so is a link."""
    if os.geteuid() != 0:
        pytest.skip("only root can create a directory owned by another user here")
    pid = dead_pid()
    theirs = make(tmp_path, f"{PREFIX}{pid}-abcd1234")
    (theirs / "model.safetensors").write_text("their weights")
    os.chown(theirs, 65534, 65534)
    target = make(tmp_path, "elsewhere")
    (tmp_path / f"{PREFIX}{pid}-linkto12").symlink_to(target)
    ours = make(tmp_path, f"{PREFIX}{pid}-efgh5678")
    assert remove_orphaned_dirs(tmp_path, PREFIX) == [ours]
    assert (theirs / "model.safetensors").exists() and target.is_dir()
