"""`relayrl bench http` end to end at a tiny size: every reply is checked for its full body,
so a transport that loses or truncates responses fails here."""

from __future__ import annotations

import pytest

from relayrl.cli import main


def test_http_bench_runs_and_ends_with_the_ratio(capsys):
    argv = ["bench", "http", "--requests", "60", "--in-flight", "12", "--latency-ms", "2"]
    assert main([*argv, "--trials", "1", "--transports", "ours,httpx"]) == 0
    out = capsys.readouterr().out.strip().splitlines()
    assert [line.split(":")[0] for line in out[:2]] == ["ours", "httpx"]
    name, value = out[-1].split("=")
    assert name == "httpx_vs_ours_cpu_per_request" and float(value) > 0


def test_http_bench_names_a_bad_transport():
    with pytest.raises(SystemExit, match="unknown: \\['curl'\\]"):
        main(["bench", "http", "--transports", "ours,curl"])
