"""`relayrl bench engine --model DIR --batches ...` end to end at a tiny size: one comparison
per batch size, the machine's limits and the built-in engine's roofline fraction, and the
ratio as the last line; the roofline by hand."""

from __future__ import annotations

import pytest

from relayrl.bench.engine import MachineLimits, parse_batches
from relayrl.cli import main
from relayrl.errors import RelayError


def test_roofline_by_hand():
    limits = MachineLimits(flops=100e9, bytes_per_s=20e9)
    # 100 passes reading 0.54 GB each (2.7 s) outlast 2·135M·500 FLOP (1.35 s)
    assert limits.seconds(135_000_000, 540_000_000, 100, 500) == pytest.approx(2.7)
    # 10 passes (0.27 s) over 2000 tokens (5.4 s): compute-bound
    assert limits.seconds(135_000_000, 540_000_000, 10, 2000) == pytest.approx(5.4)


def test_bad_batches_name_the_option():
    assert parse_batches("1,8", 16) == [1, 8]
    assert parse_batches(None, 16) == [16]
    with pytest.raises(RelayError, match="--batches"):
        parse_batches("1,x", 16)


def test_engine_bench_on_a_model_directory(tiny_model_dir, capsys):
    argv = ["bench", "engine", "--quick", "--model", str(tiny_model_dir), "--batches", "2,4"]
    assert main([*argv, "--requests", "6", "--max-len", "12"]) == 0
    out = capsys.readouterr().out.strip().splitlines()
    assert out[0].startswith(f"model={tiny_model_dir} machine: matmul_gflops=")
    assert sum(line.startswith("batch=") for line in out) == 2
    fractions = [line for line in out if "engine_fraction_of_roofline=" in line]
    assert len(fractions) == 2
    assert {line.split("=")[0] for line in out[-3:-1]} == {
        "engine_speedup_vs_hf_generate_b2",
        "engine_speedup_vs_hf_generate_b4",
    }
    name, value = out[-1].split("=")
    assert name == "engine_speedup_vs_hf_generate" and float(value) > 0
