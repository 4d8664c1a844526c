"""Issue 36, sandbox rows 3-4: the sandbox fails loudly (a probe at pool start, a re-probe
when a whole batch dies, a refusal to run model-written code without isolation unless the
documented opt-out is set), non-root runs, and only registered sandbox uids are killed."""

from __future__ import annotations

import json
import os
import shutil
import stat
import subprocess
import sys
import time
from pathlib import Path

import pytest

from relayrl.cli import main
from relayrl.config.schema import RunConfig
from relayrl.rewards import sandbox
from relayrl.rewards.code import probe_code_grading
from relayrl.rewards.pool import GradingPool
from relayrl.rewards.sandbox import (
    ALLOW_UNISOLATED_ENV,
    SandboxUnavailable,
    allow_unisolated,
    probe_sandbox,
    python_argv,
    run_sandboxed,
    sandbox_settings,
)
from relayrl.tasks.base import Problem

ROOT = Path(__file__).resolve().parents[2]
TEST_UID = 4242
SYSTEM_PYTHON = "/usr/bin/python3"
ADD = {
    "prompt": "def add(a, b):\n",
    "test": "def check(candidate):\n    assert candidate(2, 3) == 5\n",
    "entry_point": "add",
}


def _problem(i: int) -> Problem:
    return Problem(id=f"p{i}", prompt=ADD["prompt"], answer="", grader="code", meta=ADD)


def test_the_probe_passes_on_a_working_backend(backend: str) -> None:
    assert probe_sandbox() == backend
    assert probe_code_grading() == backend


def test_a_missing_interpreter_fails_the_probe_naming_the_backend(
    backend: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The interpreter the sandbox cannot find (the old /tmp case): an error, not 0s."""
    monkeypatch.setenv("RELAYRL_SANDBOX_PYTHON", "/nonexistent/bin/python3")
    with pytest.raises(SandboxUnavailable) as caught:
        probe_sandbox()
    message = str(caught.value)
    assert f"sandbox backend {backend!r} failed its probe" in message
    assert "/nonexistent/bin/python3" in message or "No such file" in message


def test_grade_stops_with_one_error_line(
    tmp_path: Path, backend: str, monkeypatch: pytest.MonkeyPatch, capsys
) -> None:
    data = tmp_path / "code.jsonl"
    row = {"id": "a", **ADD, "answer": "    return a + b\n"}
    data.write_text(json.dumps(row) + "\n")
    preds = tmp_path / "preds.jsonl"
    preds.write_text(json.dumps({"id": "a", "completion": "    return a + b\n"}) + "\n")
    assert main(["grade", "--data", str(data), "--predictions", str(preds)]) == 0
    capsys.readouterr()
    monkeypatch.setenv("RELAYRL_SANDBOX_PYTHON", "/nonexistent/bin/python3")
    assert main(["grade", "--data", str(data), "--predictions", str(preds)]) == 2
    errors = [line for line in capsys.readouterr().err.splitlines() if "error" in line]
    assert len(errors) == 1 and errors[0].startswith("error: ")
    assert f"sandbox backend {backend!r} failed its probe" in errors[0]


def test_a_batch_that_all_died_reprobes(backend: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """Candidates that all exit early with a working sandbox: rewards 0, the run goes on;
    the same batch with a broken sandbox (workers started after it broke): an error."""
    dying = "    import os\n    os._exit(0)\n"
    with GradingPool(workers=1, timeout_s=60.0) as pool:
        results = pool.grade_batch([(_problem(i), dying) for i in range(2)])
    assert [r.info["status"] for r in results] == ["candidate_died"] * 2
    monkeypatch.setenv("RELAYRL_SANDBOX_PYTHON", "/nonexistent/bin/python3")
    with GradingPool(workers=1, timeout_s=60.0) as pool:
        with pytest.raises(SandboxUnavailable, match=f"backend {backend!r} failed its probe"):
            pool.grade_batch([(_problem(i), "    return a + b\n") for i in range(2)])


def test_the_opt_out_lasts_only_as_long_as_its_run(monkeypatch) -> None:
    """``sandbox.allow_unisolated`` is applied for a run's ``with`` block and restored after
    it (issue 46: it stayed in the process environment, so a later run in the same process,
    a benchmark's or an experiment's, ran model-written code unisolated without asking)."""
    monkeypatch.delenv(ALLOW_UNISOLATED_ENV, raising=False)
    with sandbox_settings(True):
        assert allow_unisolated()
    assert ALLOW_UNISOLATED_ENV not in os.environ and not allow_unisolated()
    with sandbox_settings(False):
        assert not allow_unisolated()
    monkeypatch.setenv(ALLOW_UNISOLATED_ENV, "1")  # the user's own opt-out survives a run
    with pytest.raises(RuntimeError), sandbox_settings(True):
        raise RuntimeError("the run failed")
    assert os.environ[ALLOW_UNISOLATED_ENV] == "1"


def test_the_opt_out_is_a_documented_config_key() -> None:
    assert RunConfig().sandbox.allow_unisolated is False
    assert RunConfig.model_validate({"sandbox": {"allow_unisolated": True}}).sandbox
    reference = (ROOT / "docs" / "config.md").read_text()
    assert "allow_unisolated" in reference


# -- non-root ----------------------------------------------------------------------------------

# Run as root: fork; the child (optionally in a user namespace where user namespaces are
# off, like Docker's default seccomp profile) becomes TEST_UID and runs the script.
AS_USER = r"""
import ctypes, os, sys
uid, no_userns, script = int(sys.argv[1]), sys.argv[2] == "1", sys.argv[3]
libc = ctypes.CDLL(None, use_errno=True)
go_r, go_w = os.pipe()
ready_r, ready_w = os.pipe()
pid = os.fork()
if pid == 0:
    if no_userns:
        assert libc.unshare(0x10000000) == 0, os.strerror(ctypes.get_errno())
        os.write(ready_w, b"x")
        os.read(go_r, 1)
        open("/proc/sys/user/max_user_namespaces", "w").write("0")
    os.setgroups([])
    os.setgid(uid)
    os.setuid(uid)
    os.chdir("/")
    os.execv(sys.argv[4], [sys.argv[4], "-c", script])
if no_userns:
    os.read(ready_r, 1)
    for name in ("uid_map", "gid_map"):
        open(f"/proc/{pid}/{name}", "w").write("0 0 4294967295\n")
    os.write(go_w, b"x")
_, status = os.waitpid(pid, 0)
sys.exit(os.waitstatus_to_exitcode(status))
"""

USER_SCRIPT = r"""
import json, os, subprocess, tempfile
from relayrl.rewards.code import probe_code_grading
from relayrl.rewards.sandbox import SandboxUnavailable, python_argv, run_sandboxed
out = {"uid": os.getuid()}
try:
    out["probe"] = probe_code_grading()
except SandboxUnavailable as exc:
    out["probe"] = "error: " + str(exc)
private = tempfile.mkdtemp()
secret = os.path.join(private, "secret")
with open(secret, "w") as f:
    f.write("s3cret")
os.chmod(secret, 0o600)
victim = subprocess.Popen(["/usr/bin/sleep", "30"])
program = (
    "import os, signal\ntry:\n    print(open(%r).read())\nexcept OSError:\n    print('unreadable')\n"
    "try:\n    os.kill(%d, signal.SIGKILL)\n    print('killed')\nexcept OSError:\n    print('alive')\n"
) % (secret, victim.pid)
r = run_sandboxed(python_argv("p.py"), {"p.py": program})
out["run"] = [r.returncode, r.stdout.decode().split(), r.stderr.decode()[-300:]]
out["victim_alive"] = victim.poll() is None
victim.kill()
print(json.dumps(out))
"""


def _as_user(no_userns: bool, env: dict[str, str]) -> dict:
    if os.geteuid() != 0:
        pytest.skip("needs root to switch to a test user")
    if not os.path.exists(SYSTEM_PYTHON):
        pytest.skip(f"needs {SYSTEM_PYTHON} (this interpreter may be private to root)")
    for path in (ROOT, *ROOT.parents):
        if not os.stat(path).st_mode & 0o005:
            pytest.skip(f"{path} is not readable by other users")
    full_env = {"PATH": "/usr/bin:/bin", "PYTHONPATH": str(ROOT), "HOME": "/nonexistent", **env}
    args = [sys.executable, "-I", "-c", AS_USER, str(TEST_UID), "1" if no_userns else "0"]
    done = subprocess.run(
        [*args, USER_SCRIPT, SYSTEM_PYTHON],
        env=full_env,
        capture_output=True,
        text=True,
        timeout=180,
    )
    if no_userns and "AssertionError" in done.stderr:
        pytest.skip(f"cannot make a user namespace to turn them off in: {done.stderr[-200:]}")
    assert done.returncode == 0, done.stderr[-2000:]
    return json.loads(done.stdout.splitlines()[-1])


def _userns_available() -> bool:
    probe = [sys.executable, "-I", "-c", AS_USER, str(TEST_UID), "0"]
    code = "import ctypes,sys; sys.exit(ctypes.CDLL(None).unshare(0x10000000) != 0)"
    if os.geteuid() != 0:
        return False
    done = subprocess.run([*probe, code, SYSTEM_PYTHON], capture_output=True, timeout=60)
    return done.returncode == 0


@pytest.mark.parametrize("name", sandbox.BACKENDS)
def test_non_root_with_user_namespaces_is_isolated(name: str) -> None:
    """A non-root user: the probe passes; its own 0600 file is unreadable and its own
    process cannot be killed from the sandbox."""
    if os.geteuid() == 0 and not _userns_available():
        pytest.skip("user namespaces are off for non-root users on this machine")
    if name == "bwrap" and shutil.which("bwrap") is None:
        pytest.skip("bubblewrap is not installed")
    out = _as_user(False, {"RELAYRL_SANDBOX": name})
    assert out["uid"] == TEST_UID and out["probe"] == name
    returncode, stdout, stderr = out["run"]
    assert returncode == 0, stderr
    assert stdout == ["unreadable", "alive"] and out["victim_alive"]


def test_non_root_without_user_namespaces_refuses_unless_opted_out() -> None:
    """No namespace can be made: the probe refuses with one message naming the backend,
    the cause and the opt-out; nothing model-written runs (exit 125). With the opt-out set
    it runs — and reads the user's 0600 file, which is what the opt-out gives up."""
    refused = _as_user(True, {})
    assert refused["probe"].startswith("error: sandbox backend 'launcher' failed its probe")
    assert "user namespaces off?" in refused["probe"]
    assert "sandbox.allow_unisolated=true" in refused["probe"]
    assert refused["run"][0] == 125 and "relayrl-sandbox: no isolation" in refused["run"][2]
    allowed = _as_user(True, {"RELAYRL_SANDBOX_ALLOW_UNISOLATED": "1"})
    assert allowed["probe"] == "launcher"
    assert allowed["run"][0] == 0 and allowed["run"][1][0] == "s3cret"


# -- only registered uids are killed (issue 36, 4) ---------------------------------------------


def _spawn_detached(uid: int) -> subprocess.Popen:
    """A ``sleep`` in its own session as ``uid``."""
    code = (
        f"import os\nos.setsid()\nos.setgroups([])\nos.setgid({uid})\nos.setuid({uid})\n"
        "os.execv('/usr/bin/sleep', ['sleep', '60'])\n"
    )
    return subprocess.Popen([sys.executable, "-I", "-c", code])


def _alive(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except OSError:
        return False
    return state != "Z"


def test_only_registered_orphans_are_killed(tmp_path: Path) -> None:
    if os.geteuid() != 0:
        pytest.skip("sandbox uids exist only when the sandbox runs as root")
    unrelated = _spawn_detached(sandbox.BASE_UID + 100_000)  # e.g. a rootless container's
    orphan_uid = sandbox._free_uid()
    owner = subprocess.Popen([sys.executable, "-I", "-c", "import time; time.sleep(60)"])
    registered = _spawn_detached(orphan_uid)
    live_uid = sandbox._free_uid()
    live = _spawn_detached(live_uid)
    base = tmp_path / "relayrl-sbx-test"
    base.mkdir()
    try:
        sandbox._register(live_uid, tmp_path)  # owned by this (live) process
        with pytest.MonkeyPatch.context() as patch:
            patch.setattr(os, "getpid", lambda: owner.pid)
            sandbox._register(orphan_uid, base)
        owner.kill()
        owner.wait()
        time.sleep(0.2)
        killed = sandbox.kill_orphaned_sandboxes()  # (and any left by killed runs before;
        assert live_uid not in killed  # a test run beside this one may have got ours first)
        registered.wait(10)
        assert not _alive(registered.pid) and not base.exists()
        assert _alive(unrelated.pid) and _alive(live.pid)
        assert set(sandbox.registered_uids()) >= {live_uid}
        assert orphan_uid not in sandbox.registered_uids()
    finally:
        sandbox._unregister(live_uid)
        sandbox._unregister(orphan_uid)
        for process in (unrelated, registered, live, owner):
            process.kill()
            process.wait()


def test_a_finished_run_leaves_no_registration(backend: str) -> None:
    probe_sandbox()
    ours = [uid for uid, owner in sandbox.registered_uids().items() if owner["pid"] == os.getpid()]
    assert ours == []


def test_a_planted_registry_is_ignored_and_code_is_still_graded(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Another user's registry directory at the old fixed name in the shared temp directory
    (``$TMPDIR/relayrl-sandbox-uids``, here world-writable and owned by ``nobody``) is
    neither read nor used, and no longer blocks the sandbox: the registry lives in a
    directory only this user can create names in."""
    if os.geteuid() != 0:
        pytest.skip("sandbox uids exist only when the sandbox runs as root")
    monkeypatch.setenv("TMPDIR", str(tmp_path))
    monkeypatch.setattr(sandbox.tempfile, "tempdir", None)
    planted = tmp_path / "relayrl-sandbox-uids"
    planted.mkdir(mode=0o777)
    planted.chmod(0o777)
    (planted / str(sandbox.BASE_UID + 100_000)).write_text(json.dumps({"pid": 1, "start": "x"}))
    os.chown(planted, 65534, 65534)
    assert sandbox._registry_dir() != planted
    assert sandbox.BASE_UID + 100_000 not in sandbox.registered_uids()
    uid = sandbox.BASE_UID + 1
    sandbox._register(uid, tmp_path)
    try:
        assert sandbox.registered_uids()[uid]["pid"] == os.getpid()
        assert stat.S_IMODE(sandbox._registry_dir().stat().st_mode) == 0o700
    finally:
        sandbox._unregister(uid)
    result = run_sandboxed(python_argv("p.py"), {"p.py": "print('graded')"})
    assert result.returncode == 0 and result.stdout.strip() == b"graded", result
