"""`relayrl train` on bad input and failures: a bad dataset row, a dying rollout server,
Ctrl-C with server child processes."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from relayrl.errors import RelayError
from relayrl.train.run import run_train
from tests.train.conftest import rl_config


def children_of(pid: int) -> list[int]:
    """Pids whose parent is ``pid`` (from /proc)."""
    out = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            stat = (entry / "stat").read_text()
        except OSError:
            continue
        ppid = int(stat.rsplit(")", 1)[1].split()[1])
        if ppid == pid:
            out.append(int(entry.name))
    return out


def is_serve(pid: int) -> bool:
    try:
        cmd = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
    except OSError:
        return False
    return b"serve" in cmd


def alive(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except OSError:
        return False
    return state != "Z"


def test_dataset_row_missing_field_names_file_and_line(tmp_path, tiny_model_dir):
    data = tmp_path / "train.jsonl"
    data.write_text('{"id": "a", "prompt": "1+1", "answer": "2"}\n{"id": "b", "prompt": "2+2"}\n')
    config = rl_config(tmp_path, tiny_model_dir, f"rollout.dataset={data}")
    with pytest.raises(RelayError) as err:
        run_train(config)
    assert f"{data}:2" in str(err.value) and "answer" in str(err.value)


def test_dying_rollout_server_stops_the_run_naming_it(tmp_path, tiny_model_dir):
    """With no restarts allowed (tests/launch covers restarts), a dead server ends the run."""
    config = rl_config(
        tmp_path,
        tiny_model_dir,
        "rollout.server_mode=process",
        "train.total_steps=10000",
        "rollout.max_server_restarts=0",
    )
    killed: list[int] = []

    def killer() -> None:
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline and not killed:
            for pid in children_of(os.getpid()):
                if is_serve(pid) and (tmp_path / "run" / "metrics.jsonl").exists():
                    os.kill(pid, signal.SIGKILL)
                    killed.append(pid)
            time.sleep(0.2)

    thread = threading.Thread(target=killer, daemon=True)
    thread.start()
    start = time.monotonic()
    with pytest.raises(RelayError) as err:
        run_train(config)
    assert killed, "the server was never seen"
    message = str(err.value)
    assert "rollout server 0" in message and str(killed[0]) in message, message
    assert "rollout.max_server_restarts=0" in message, message
    assert time.monotonic() - start < 120


def trained_a_step(metrics: Path) -> bool:
    return metrics.exists() and '"train_tokens"' in metrics.read_text()


def test_sigint_stops_every_server_child(tmp_path, tiny_model_dir):
    args = [
        f"output_dir={tmp_path}",
        "name=run",
        f"model.path={tiny_model_dir}",
        "rollout.server_mode=process",
        "rollout.num_servers=2",
        "rollout.max_new_tokens=16",
        "rollout.prompts_per_step=2",
        "rollout.n_samples=4",
        "algo.dynamic_sampling=false",
        "train.total_steps=100000",
        "train.eval_every=0",  # a step-0 evaluation would delay the stop past the timeout
        "train.progress=false",
    ]
    code = "import sys; from relayrl.cli import main; sys.exit(main(sys.argv[1:]))"
    cfg = tmp_path / "c.yaml"
    cfg.write_text("task:\n  name: arithmetic\n")
    proc = subprocess.Popen(
        [sys.executable, "-c", code, "train", str(cfg), *args],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
    )
    try:
        servers: list[int] = []
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline:
            servers = [p for p in children_of(proc.pid) if is_serve(p)]
            if len(servers) == 2 and trained_a_step(tmp_path / "run" / "metrics.jsonl"):
                break  # training: the run's stop handler is installed
            assert proc.poll() is None, proc.stdout.read().decode()
            time.sleep(0.2)
        assert len(servers) == 2
        proc.send_signal(signal.SIGINT)
        out, _ = proc.communicate(timeout=60)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == 130, out.decode()[-2000:]
    time.sleep(0.5)
    assert not [p for p in servers if alive(p)]
