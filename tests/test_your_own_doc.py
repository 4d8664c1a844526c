"""docs/your-own.md, run as written: its files are saved and its shell blocks run, in order,
in a fresh directory outside the checkout (a user's model, dataset, reward, task and loss,
from the command line)."""

from __future__ import annotations

import os
import re
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
DOC = ROOT / "docs" / "your-own.md"
BLOCK = re.compile(r"```(python|yaml|bash)\n(.*?)```", re.S)


def doc_blocks() -> list[tuple[str, str]]:
    return BLOCK.findall(DOC.read_text())


def run_shell(block: str, cwd: Path) -> str:
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}
    env["PATH"] = f"{Path(sys.executable).parent}{os.pathsep}{env.get('PATH', '')}"
    env.pop("RELAYRL_PLUGINS", None)
    done = subprocess.run(
        ["bash", "-euo", "pipefail", "-c", block],
        cwd=cwd,
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert done.returncode == 0, f"$ {block}\n{done.stdout[-3000:]}\n{done.stderr[-3000:]}"
    return done.stdout + done.stderr


def test_every_block_of_the_page_runs(tmp_path):
    blocks = doc_blocks()
    files = [b for kind, b in blocks if kind != "bash"]
    assert all(b.startswith("# file: ") for b in files), "a code block without # file: NAME"
    assert sum(kind == "bash" for kind, _ in blocks) == 5
    output = ""
    for kind, block in blocks:
        if kind == "bash":
            start = time.monotonic()
            output += run_shell(block, tmp_path)
            print(f"{time.monotonic() - start:.1f}s: {block.splitlines()[0]}")
        else:
            name, body = block.split("\n", 1)
            (tmp_path / name.removeprefix("# file: ").strip()).write_text(body)
    assert output.count("final_pass@1=") == 3
    assert output.count("pass@1=") >= 7  # four evals and three runs
    columns = "['choices', 'question', 'solution']"
    assert (
        f"rollout.dataset.answer_field='answer': no such column; the row's columns: {columns}"
        in output
    )
    assert (
        f"qa_test.jsonl:1: --answer-field='soluton': no such column; the row's columns: "
        f"{columns}; did you mean 'solution'?" in output
    )
    assert "dataset: chain_sum" in output  # the reasoning_gym task's config
    assert "unknown task 'sumz' (did you mean 'sums'?)" in output
    for run in ("mine", "qa", "plugged"):
        assert (tmp_path / "runs" / run / "metrics.jsonl").is_file()
    assert not (tmp_path / "runs" / "qa_typo" / "metrics.jsonl").exists()
    saved = (tmp_path / "runs" / "plugged" / "config.yaml").read_text()
    assert str(tmp_path / "my_plugin.py") in saved
