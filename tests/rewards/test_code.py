"""Code grading: HumanEval canonical solutions pass, mutants fail, and adversarial programs
neither pass nor harm the host or this test process, under each sandbox backend
(bubblewrap and the stand-alone launcher)."""

from __future__ import annotations

import os
import socket
import sys
import threading
import time
import uuid
from pathlib import Path

import pytest

from relayrl.rewards import sandbox
from relayrl.rewards.code import build_program, extract_code, grade_code
from relayrl.rewards.pool import GradingPool
from relayrl.rewards.sandbox import BASE_UID, SandboxLimits, python_argv, run_sandboxed
from relayrl.tasks.datasets import load_problems
from tests.conftest import rows_in

LIMITS = SandboxLimits(wall_s=4.0, cpu_s=3, memory_mb=512, nproc=4)
PROMPT = "def add(a, b):\n"
TEST = "def check(candidate):\n    assert candidate(2, 3) == 5\n    assert candidate(-1, 1) == 0\n"


def _sandbox_pids() -> list[int]:
    """Live processes under a sandbox uid, but for those of sandboxes other processes hold
    now (a uid stays registered to its owner until its last process is gone: another test
    process grading at the same time, e.g. the other pytest-xdist worker)."""
    others = {
        uid
        for uid, owner in sandbox.registered_uids().items()
        if owner.get("pid") != os.getpid()
        and sandbox._start_ticks(int(owner.get("pid", 0))) == owner.get("start")  # alive
    }
    pids = []
    for entry in os.scandir("/proc"):
        if entry.name.isdigit():
            try:
                status = Path(f"/proc/{entry.name}/status").read_text()
            except OSError:
                continue
            fields = dict(line.split(":", 1) for line in status.splitlines() if ":" in line)
            uid = int(fields["Uid"].split()[0])
            if (
                uid >= BASE_UID
                and uid not in others
                and not fields["State"].strip().startswith("Z")
            ):
                pids.append(int(entry.name))
    return pids


def test_humaneval_canonical_pass_and_mutants_fail(benchmark_data: Path) -> None:
    problems = load_problems("humaneval", data_root=benchmark_data)
    items = [(p, p.answer) for p in problems] + [(p, "    return None\n") for p in problems]
    with GradingPool(workers=2, timeout_s=60.0) as pool:
        results = pool.grade_batch(items)
    canonical, mutants = results[: len(problems)], results[len(problems) :]
    failed = [(p.id, r.info) for p, r in zip(problems, canonical, strict=True) if r.reward != 1.0]
    passed_mutants = [p.id for p, r in zip(problems, mutants, strict=True) if r.reward != 0.0]
    assert len(problems) == rows_in(benchmark_data, "humaneval/test.jsonl")
    assert failed == [] and passed_mutants == []


def test_correct_candidate_passes_in_chat_format() -> None:
    reply = "Here you go:\n```python\ndef add(a, b):\n    return a + b\n```\nDone."
    assert extract_code(reply).startswith("def add")
    assert build_program(PROMPT, reply, "add").startswith("def add")
    verdict = grade_code(reply, PROMPT, TEST, "add", LIMITS)
    assert verdict.passed and verdict.calls == 2
    assert not grade_code("    return a - b\n", PROMPT, TEST, "add", LIMITS).passed


ADVERSARIAL = {
    "infinite_loop": "    while True:\n        pass\n",
    "fork_bomb": "    import os\n    while True:\n        try:\n            os.fork()\n        except OSError:\n            pass\n",
    "memory_hog": "    x = bytearray(8 << 30)\n    return 5\n",
    "kill_parent": "    import os, signal\n    os.kill(os.getppid(), signal.SIGKILL)\n    return None\n",
    "flood_stdout": "    import sys\n    while True:\n        sys.stdout.write('PASSED ' * 1000)\n",
    "exit_before_tests": "    pass\nimport sys\nsys.exit(0)\n",
    "os_exit_at_load": "    pass\nimport os\nos._exit(0)\n",
    "os_exit_in_call": "    import os\n    os._exit(0)\n",
    "print_passed": "    print('PASSED'); print('all tests passed')\n    return None\n",
    "redefine_check": (
        "    return None\n"
        "def check(candidate):\n    pass\n"
        "import builtins\nbuiltins.AssertionError = type('X', (BaseException,), {})\n"
        "builtins.check = check\n"
    ),
    "always_equal": "    class E:\n        def __eq__(self, other):\n            return True\n    return E()\n",
    "thread_bomb": (
        "    import threading, time\n    while True:\n"
        "        threading.Thread(target=time.sleep, args=(100,)).start()\n"
    ),
    "setsid_daemon": (
        "    import os, time\n    if os.fork() == 0:\n        os.setsid()\n"
        "        time.sleep(60)\n    return None\n"
    ),
    "stderr_flood": "    import sys\n    while True:\n        sys.stderr.write('x' * 65536)\n",
    "overwrite_runner": "    open('runner.py', 'w').write('print(1)')\n    return None\n",
    "int_subclass": "    class I(int):\n        def __eq__(self, other):\n            return True\n    return I(0)\n",
    "fake_reply": '    import os\n    for fd in range(3, 20):\n        try:\n            os.write(fd, b\'{"ok": {"i": "5"}}\\n{"ok": {"i": "0"}}\\n\')\n        except OSError:\n            pass\n    os._exit(0)\n',
}


@pytest.mark.parametrize("name", sorted(ADVERSARIAL))
def test_adversarial_programs_never_pass(name: str, backend: str) -> None:
    start = time.monotonic()
    verdict = grade_code(ADVERSARIAL[name], PROMPT, TEST, "add", LIMITS)
    assert not verdict.passed, verdict
    assert time.monotonic() - start < LIMITS.wall_s + 3
    assert _sandbox_pids() == []  # nothing left running (fork bomb included)


def test_writes_outside_workdir_do_not_reach_host(tmp_path: Path, backend: str) -> None:
    tmp_path.chmod(0o777)
    marker = f"/tmp/relayrl-escape-{uuid.uuid4().hex}"
    targets = [marker, str(tmp_path / "escape.txt"), str(Path(__file__).parent / "escape.txt")]
    body = "".join(
        f"    try:\n        open({t!r}, 'w').write('x')\n    except OSError:\n        pass\n"
        for t in targets
    )
    verdict = grade_code(body + "    return None\n", PROMPT, TEST, "add", LIMITS)
    assert not verdict.passed
    assert not any(Path(t).exists() for t in targets)


def test_no_network_and_scrubbed_environment(monkeypatch: pytest.MonkeyPatch, backend: str) -> None:
    secret = uuid.uuid4().hex
    monkeypatch.setenv("RELAYRL_FAKE_SECRET", secret)
    server = socket.socket()
    server.bind(("127.0.0.1", 0))
    server.listen()
    server.settimeout(0.2)
    port = server.getsockname()[1]
    accepted: list[object] = []
    checked = threading.Event()  # the sandboxed programs are done: nothing more can connect

    def serve() -> None:
        deadline = time.monotonic() + 6
        while time.monotonic() < deadline and not checked.is_set():
            try:
                accepted.append(server.accept())
            except OSError:
                continue

    thread = threading.Thread(target=serve)
    thread.start()
    try:
        connect = (
            "def connect():\n    import socket\n    try:\n"
            f"        socket.create_connection(('127.0.0.1', {port}), timeout=2)\n"
            "        return 'connected'\n    except OSError as e:\n        return str(e)\n"
        )
        test = "def check(candidate):\n    assert candidate() == 'connected'\n"
        assert not grade_code(connect, "", test, "connect", LIMITS).passed
        leak = "def leak():\n    import os\n    return os.environ.get('RELAYRL_FAKE_SECRET')\n"
        test = "import os\ndef check(candidate):\n    assert candidate() == os.environ['RELAYRL_FAKE_SECRET']\n"
        assert not grade_code(leak, "", test, "leak", LIMITS).passed
        shown = run_sandboxed(
            python_argv("p.py"), {"p.py": "import os\nprint(dict(os.environ))"}, LIMITS
        )
        assert shown.returncode == 0 and secret.encode() not in shown.stdout
        assert b"PATH" in shown.stdout
    finally:
        checked.set()
        thread.join()
        server.close()
    assert accepted == []


def test_a_minimal_read_only_root_and_its_own_pid_namespace(backend: str) -> None:
    """The sandbox's root holds the system directories and nothing of the host's tree;
    /usr is read-only; /proc shows the run's own processes only; a per-run uid as root."""
    probe = (
        "import os\n"
        "print(bool(os.statvfs('/usr').f_flag & os.ST_RDONLY))\n"
        "print(len([p for p in os.listdir('/proc') if p.isdigit()]))\n"
        f"print(os.geteuid() == 0 or os.getuid() >= {BASE_UID})\n"
        "print(','.join(sorted(os.listdir('/'))))\n"
    )
    shown = run_sandboxed(python_argv("p.py"), {"p.py": probe}, LIMITS)
    read_only, processes, own_uid, top = shown.stdout.decode().split()
    assert shown.returncode == 0 and read_only == "True" and own_uid == "True", shown
    assert int(processes) <= 3  # an init, the command: nothing of the host
    host_only = {"home", "work", "root", "srv", "mnt", "opt", "var", "run", "etc", "sys"}
    allowed = {"bin", "sbin", "lib", "lib32", "lib64", "libx32", "usr", "dev", "proc", "tmp"}
    allowed |= {"etc", "var", "run"}  # /etc: ld.so.cache and localtime; /var/tmp; the launcher
    prefix_top = Path(sys.base_prefix).resolve().parts[1]
    assert set(top.split(",")) <= allowed | {prefix_top}, top
    assert not (set(top.split(",")) & (host_only - allowed - {prefix_top}))


def test_unknown_backend_is_named(monkeypatch) -> None:
    monkeypatch.setenv("RELAYRL_SANDBOX", "docker")
    with pytest.raises(
        ValueError, match="RELAYRL_SANDBOX='docker'; expected auto, bwrap or launcher"
    ):
        sandbox.sandbox_backend()
