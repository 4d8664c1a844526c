"""Issue 36, sandbox rows: model-written code cannot read the dataset it is graded on (reward
forgery), the project tree, home or runs; and the interpreter is found wherever it lives,
``/tmp`` included. Each under both backends (bubblewrap and the stand-alone launcher)."""

from __future__ import annotations

import asyncio
import json
import os
import shutil
import subprocess
import sys
import time
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest

from relayrl.cli import main
from relayrl.rewards.sandbox import SandboxLimits, python_argv, run_sandboxed
from relayrl.rollout.tools import ToolError, run_python

ROOT = Path(__file__).resolve().parents[2]
LIMITS = SandboxLimits(wall_s=6.0, cpu_s=4, memory_mb=512, nproc=4)
PROBLEMS = [
    {
        "id": "HumanEval/0",
        "task_id": "HumanEval/0",
        "prompt": "def add(a, b):\n",
        "canonical_solution": "    return a + b\n",
        "test": "def check(candidate):\n    assert candidate(2, 3) == 5\n    assert candidate(7, -7) == 0\n",
        "entry_point": "add",
    },
    {
        "id": "HumanEval/1",
        "task_id": "HumanEval/1",
        "prompt": "def rev(s):\n",
        "canonical_solution": "    return s[::-1]\n",
        "test": "def check(candidate):\n    assert candidate('abc') == 'cba'\n    assert candidate('') == ''\n",
        "entry_point": "rev",
    },
]


def _forgery(paths: list[str], problem: dict) -> str:
    """A function body for ``problem`` that finds its own problem in a dataset file and
    calls the canonical solution with its arguments: it passes wherever the file is
    readable."""
    entry = problem["entry_point"]
    return (
        "    import json as _j, sys as _s\n"
        "    _c = _s._getframe().f_code\n"
        "    _l = dict(locals())\n"
        "    _args = [_l[n] for n in _c.co_varnames[: _c.co_argcount]]\n"
        f"    for _p in {paths!r}:\n"
        "        try:\n"
        "            _rows = [_j.loads(l) for l in open(_p)]\n"
        "        except OSError:\n"
        "            continue\n"
        "        for _r in _rows:\n"
        f"            if _r.get('entry_point') == {entry!r}:\n"
        "                _ns = {}\n"
        "                exec(_r['prompt'] + _r['canonical_solution'], _ns)\n"
        f"                return _ns[{entry!r}](*_args)\n"
        "    return None\n"
    )


@pytest.fixture
def planted_dataset() -> Iterator[Path]:
    """A world-readable HumanEval-format file in the project's ``runs/`` (outside ``/tmp``,
    where the real ../shared/data lives relative to a checkout)."""
    directory = ROOT / "runs" / f"sandbox-test-{uuid.uuid4().hex[:8]}"
    data = directory / "data" / "humaneval" / "test.jsonl"
    data.parent.mkdir(parents=True)
    data.write_text("".join(json.dumps(row) + "\n" for row in PROBLEMS))
    for path in (data, *list(data.parents)[:4]):
        path.chmod(0o755 if path.is_dir() else 0o644)
    yield data
    shutil.rmtree(directory, ignore_errors=True)


def test_the_forgery_passes_where_the_file_is_readable(planted_dataset: Path) -> None:
    """Control: outside a sandbox the forging completion does pass its problem's test."""
    for problem in PROBLEMS:
        namespace: dict = {}
        exec(problem["prompt"] + _forgery([str(planted_dataset)], problem), namespace)
        exec(problem["test"], namespace)
        namespace["check"](namespace[problem["entry_point"]])


def test_grade_humaneval_forgery_scores_zero(
    planted_dataset: Path, tmp_path: Path, backend: str, capsys: pytest.CaptureFixture[str]
) -> None:
    """``relayrl grade --data humaneval``: canonical solutions score 1, completions that read
    their own problem's solution from the dataset score 0."""
    real = ROOT.parent / "shared" / "data" / "humaneval" / "test.jsonl"  # as tests/conftest.py
    paths = [str(planted_dataset), str(real), str(real.resolve())]
    preds = tmp_path / "preds.jsonl"
    rows = [{"id": p["id"], "completion": p["canonical_solution"]} for p in PROBLEMS]
    rows += [{"id": p["id"], "completion": _forgery(paths, p)} for p in PROBLEMS]
    preds.write_text("".join(json.dumps(r) + "\n" for r in rows))
    out = tmp_path / "verdicts.jsonl"
    root = planted_dataset.parents[1]
    args = ["grade", "--data", "humaneval", "--data-root", str(root), "--workers", "1"]
    assert main([*args, "--predictions", str(preds), "--out", str(out)]) == 0
    assert capsys.readouterr().out.strip().splitlines()[-1] == "accuracy=0.5000"
    verdicts = [json.loads(line) for line in out.read_text().splitlines()]
    assert [v["correct"] for v in verdicts] == [True, True, False, False]
    assert {v["status"] for v in verdicts[2:]} == {"test_failed"}  # ran, found no file


def test_grade_real_humaneval_forgery_scores_zero(
    benchmark_data: Path, tmp_path: Path, backend: str, capsys: pytest.CaptureFixture[str]
) -> None:
    """The same on the real HumanEval file: its first two problems, canonical vs forged."""
    data = benchmark_data / "humaneval" / "test.jsonl"
    problems = [json.loads(line) for line in data.open()][:2]
    paths = [str(data), str(data.resolve())]
    rows = [{"id": p["id"], "completion": p["canonical_solution"]} for p in problems]
    rows += [{"id": p["id"], "completion": _forgery(paths, p)} for p in problems]
    preds = tmp_path / "preds.jsonl"
    preds.write_text("".join(json.dumps(r) + "\n" for r in rows))
    for problem in problems:  # control: it passes where the file is readable
        namespace: dict = {}
        exec(problem["prompt"] + _forgery(paths, problem) + problem["test"], namespace)
        namespace["check"](namespace[problem["entry_point"]])
    args = ["grade", "--data", "humaneval", "--data-root", str(benchmark_data), "--workers", "1"]
    assert main([*args, "--predictions", str(preds)]) == 0
    assert capsys.readouterr().out.strip().splitlines()[-1] == "accuracy=0.5000"


def _home_entries() -> list[str]:
    """Entries of the home directory, but the one leading to the interpreter's prefix (its
    prefix is bound wherever it lives, ``~/.pyenv`` included)."""
    prefix = Path(sys.base_prefix).resolve()
    home = Path.home()
    entries = sorted(home.iterdir()) if home.is_dir() else []
    return [str(e) for e in entries if not prefix.is_relative_to(e)][:20] or [str(home / "x")]


def test_host_paths_are_not_visible(planted_dataset: Path, backend: str) -> None:
    """Dataset, project tree, home, run directories and host temp files do not exist for
    sandboxed code (read or listed)."""
    host_tmp = Path("/tmp") / f"relayrl-visible-{uuid.uuid4().hex}"
    host_tmp.write_text("secret")
    try:
        paths = [
            str(planted_dataset),
            str(planted_dataset.parents[3]),  # runs/
            str(ROOT / "relayrl" / "rewards" / "code.py"),
            str(ROOT),
            *_home_entries(),
            str(host_tmp),
            "/work",
            "/etc/passwd",
            "/run/lock",
            "/var/run",
            "/sys",
        ]
        probe = f"import os\nprint([p for p in {paths!r} if os.path.exists(p)])\n"
        shown = run_sandboxed(python_argv("p.py"), {"p.py": probe}, LIMITS)
        assert shown.returncode == 0, shown.stderr[-500:]
        assert shown.stdout.decode().strip() == "[]"
    finally:
        host_tmp.unlink()


def test_python_tool_cannot_read_the_dataset(planted_dataset: Path, backend: str) -> None:
    """The python tool of tool-use episodes returns file contents straight to the model."""
    code = f"print(open({str(planted_dataset)!r}).read())"
    with pytest.raises(ToolError, match="FileNotFoundError"):
        asyncio.run(run_python(code))
    assert asyncio.run(run_python("print(sum(range(10)))")) == "45"


def _copy_interpreter_prefix(target: Path) -> Path:
    """A copy of this interpreter's prefix (binary, libpython, standard library) under
    ``target``; the path of its python."""
    base = Path(sys.base_prefix).resolve()
    real = Path(getattr(sys, "_base_executable", sys.executable)).resolve()
    version = f"python{sys.version_info.major}.{sys.version_info.minor}"
    skip = shutil.ignore_patterns("test", "tests", "site-packages", "idlelib", "tkinter",
                                  "turtledemo", "ensurepip", "lib2to3", "config-*")  # fmt: skip
    shutil.copytree(base / "lib" / version, target / "lib" / version, ignore=skip)
    for lib in (base / "lib").glob("libpython*"):
        shutil.copy2(lib, target / "lib" / lib.name, follow_symlinks=False)
    (target / "bin").mkdir()
    shutil.copy2(real, target / "bin" / version)
    for path in (target, *target.parents):
        if str(path) == "/tmp":
            break
        path.chmod(0o755)
    return target / "bin" / version


GRADE_SCRIPT = """
from relayrl.rewards.code import grade_code
from relayrl.rewards.sandbox import sandbox_python
test = "def check(candidate):\\n    assert candidate(2, 3) == 5\\n"
good = grade_code("    return a + b\\n", "def add(a, b):\\n", test, "add")
bad = grade_code("    return a - b\\n", "def add(a, b):\\n", test, "add")
print(sandbox_python(), good.status, bad.status)
"""


@pytest.mark.parametrize("layout", ["venv", "prefix"])
def test_an_interpreter_under_tmp_grades(tmp_path: Path, backend: str, layout: str) -> None:
    """A checkout's venv under /tmp (symlinks to the base interpreter), and an interpreter
    prefix itself under /tmp: canonical code passes, wrong code fails (the old private
    /tmp hid the interpreter and every reward became 0)."""
    assert str(tmp_path).startswith("/tmp/")
    if layout == "venv":
        base = Path(getattr(sys, "_base_executable", sys.executable))
        subprocess.run([str(base), "-m", "venv", "--without-pip", str(tmp_path / "venv")],
                       check=True, timeout=120)  # fmt: skip
        python = tmp_path / "venv" / "bin" / "python"
    else:
        python = _copy_interpreter_prefix(tmp_path / "prefix")
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    env.pop("RELAYRL_SANDBOX_PYTHON", None)
    done = subprocess.run(
        [str(python), "-c", GRADE_SCRIPT], env=env, capture_output=True, text=True, timeout=120
    )
    assert done.returncode == 0, done.stderr[-2000:]
    used, good, bad = done.stdout.split()
    assert (good, bad) == ("ok", "test_failed")
    if layout == "prefix":
        assert used == str(python.resolve())  # the copy under /tmp ran the candidate


# -- IPC, PID, host writes, sockets, run-wide memory, groups (issue 36, 2) -------------------


def _run(program: str, limits: SandboxLimits = LIMITS) -> str:
    shown = run_sandboxed(python_argv("p.py"), {"p.py": program}, limits)
    assert shown.returncode == 0, shown.stderr[-1000:]
    return shown.stdout.decode().strip()


def test_sysv_shared_memory_does_not_survive_the_run(backend: str) -> None:
    key = 0x52524C00 + int(uuid.uuid4().hex[:4], 16)
    program = (
        "import ctypes\n"
        "libc = ctypes.CDLL(None, use_errno=True)\n"
        f"ids = [libc.shmget({key} + i, 64 << 20, 0o1666) for i in range(3)]\n"
        "print(all(i >= 0 for i in ids))\n"
    )
    assert _run(program) == "True"  # the segments were made, in the run's IPC namespace
    host = Path("/proc/sysvipc/shm").read_text().splitlines()[1:]
    assert not [line for line in host if int(line.split()[0]) in (key, key + 1, key + 2)]


def test_writes_to_host_run_and_shm_do_not_land(backend: str) -> None:
    name = f"relayrl-escape-{uuid.uuid4().hex}"
    targets = [f"/run/lock/{name}", f"/dev/shm/{name}", f"/var/tmp/{name}", f"/run/{name}"]
    program = "".join(
        f"try:\n    open({t!r}, 'w').write('x')\nexcept OSError:\n    pass\n" for t in targets
    )
    _run(program + "print('done')")
    assert not [t for t in targets if Path(t).exists()]


def test_other_processes_command_lines_are_not_readable(backend: str) -> None:
    token = f"--api-key=relayrl-{uuid.uuid4().hex}"
    other = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(30)", token])
    try:
        deadline = time.monotonic() + 10
        while token.encode() not in Path(f"/proc/{other.pid}/cmdline").read_bytes():
            assert time.monotonic() < deadline, "sleep did not start"
            time.sleep(0.01)
        program = (
            "import os\nseen = []\n"
            "for p in (os.listdir('/proc') if os.path.isdir('/proc') else []):\n"
            "    try:\n        seen.append(open(f'/proc/{p}/cmdline', 'rb').read())\n"
            "    except OSError:\n        pass\n"
            f"print({token.encode()!r} in b''.join(seen), len(seen) > 0 or 'no-proc')\n"
            "print(os.readlink('/proc/self/ns/pid') if os.path.isdir('/proc/self') else '-')\n"
            "print(os.readlink('/proc/self/ns/ipc') if os.path.isdir('/proc/self') else '-')\n"
        )
        found, listed, pid_ns, ipc_ns = _run(program).split()
        assert found == "False" and listed == "True"
        assert pid_ns != os.readlink("/proc/self/ns/pid")
        assert ipc_ns != os.readlink("/proc/self/ns/ipc")
    finally:
        other.kill()
        other.wait()


def test_host_unix_sockets_are_not_reachable(tmp_path: Path, backend: str) -> None:
    """A pathname socket (stand-in for docker.sock, in /run and in a world-open /tmp dir)
    and an abstract one: connecting fails."""
    import socket

    tmp_path.chmod(0o777)
    paths = [str(tmp_path / "docker.sock"), f"/run/relayrl-{uuid.uuid4().hex[:8]}.sock"]
    abstract = f"\0relayrl-{uuid.uuid4().hex}"
    servers = []
    try:
        for address in (*paths, abstract):
            server = socket.socket(socket.AF_UNIX)
            server.bind(address)
            server.listen()
            servers.append(server)
            if not address.startswith("\0"):
                os.chmod(address, 0o777)
        program = (
            "import socket\nreached = []\n"
            f"for a in {[*paths, abstract]!r}:\n"
            "    s = socket.socket(socket.AF_UNIX)\n"
            "    try:\n        s.connect(a)\n        reached.append(a)\n"
            "    except OSError:\n        pass\n"
            "print(len(reached))\n"
        )
        assert _run(program) == "0"
    finally:
        for server in servers:
            server.close()
        for path in paths:
            Path(path).unlink(missing_ok=True)


def test_memory_cap_is_run_wide(backend: str) -> None:
    """3 children x 700 MiB under a 1024 MiB cap: none gets its 700 MiB, while one process
    still gets 200 MiB (the cap is a budget, not zero)."""
    limits = SandboxLimits(wall_s=10.0, cpu_s=8, memory_mb=1024, nproc=4)
    program = (
        "import os\n"
        "x = bytearray(200 << 20)\n"
        "del x\n"
        "got = 0\n"
        "for _ in range(3):\n"
        "    r, w = os.pipe()\n"
        "    try:\n        pid = os.fork()\n    except OSError:\n        continue\n"
        "    if pid == 0:\n"
        "        try:\n            b = bytearray(700 << 20)\n            os.write(w, b'1')\n"
        "        except MemoryError:\n            os.write(w, b'0')\n"
        "        os._exit(0)\n"
        "    os.waitpid(pid, 0)\n"
        "    got += os.read(r, 1) == b'1'\n"
        "print(got)\n"
    )
    assert _run(program, limits) == "0"


def test_supplementary_groups_are_dropped(backend: str) -> None:
    if os.geteuid() != 0:
        pytest.skip("runs as root: the sandbox switches to a per-run uid with no groups")
    program = "import os\nprint(os.getgroups(), os.getuid() == os.getgid() != 0)\n"
    assert _run(program) == "[] True"
