import json

import pytest

from relayrl.cli import main


def _last_lines(capsys):
    return capsys.readouterr().out.strip().splitlines()


def run_eval(model_dir, data: str, out, *extra: str) -> int:
    """``relayrl eval`` on one thread writing ``out``; ``extra`` are more options."""
    args = ["eval", "--model", str(model_dir), "--data", data, "--threads", "1"]
    return main([*args, "--out", str(out), *extra])


def test_eval_synthetic_task_reports_pass_at_k_and_maj_at_k(tiny_model_dir, tmp_path, capsys):
    out = tmp_path / "eval.jsonl"
    code = run_eval(
        tiny_model_dir, "arithmetic", out, "--limit", "6", "--n", "4", "--max-new-tokens", "24"
    )
    assert code == 0
    lines = _last_lines(capsys)
    assert lines[-1].startswith("pass@1=")
    assert any(line.startswith("pass@4=") for line in lines)
    assert any(line.startswith("maj@4=") for line in lines)
    rows = [json.loads(x) for x in out.read_text().splitlines()]
    assert len(rows) == 6 and all(len(r["completions"]) == 4 for r in rows)
    # an untrained model: pass@1 is the mean of the per-sample rewards
    mean = sum(sum(r["rewards"]) for r in rows) / 24
    assert lines[-1] == f"pass@1={mean:.4f}"


@pytest.mark.parametrize("data", ["gsm8k", "humaneval"])
def test_eval_real_benchmark_runs_without_errors(
    data, tiny_model_dir, tmp_path, capsys, benchmark_data
):
    out = tmp_path / "eval.jsonl"
    code = run_eval(
        tiny_model_dir,
        data,
        out,
        *("--limit", "3", "--max-new-tokens", "16", "--data-root", str(benchmark_data)),
        *("--timeout", "20"),
    )
    assert code == 0
    lines = _last_lines(capsys)
    value = float(lines[-1].removeprefix("pass@1="))
    assert 0.0 <= value <= 1.0  # a random 0.4M model: near zero, but it must run cleanly
    assert sum(1 for _ in out.open()) == 3


def test_eval_bad_model_path_is_a_clear_error(tmp_path, capsys):
    code = main(["eval", "--model", str(tmp_path / "nope"), "--data", "arithmetic"])
    assert code != 0
    assert "is not a directory" in capsys.readouterr().err
