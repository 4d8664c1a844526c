"""`relayrl bench publish --lora R` on the tiny preset, one round: both publication kinds go
through real servers, and the adapter snapshot is the adapters' size (rank 8 on every linear
layer of the tiny model: 9 % of the full snapshot's bytes)."""

from __future__ import annotations

import argparse
import re

from relayrl.bench import publish


def test_bench_publish_lora_reports_bytes_and_latency(capsys):
    parser = argparse.ArgumentParser()
    publish.add_arguments(parser)
    args = parser.parse_args(["--lora", "8", "--presets", "tiny", "--rounds", "1"])
    assert publish.run(args) == 0
    out = capsys.readouterr().out
    sizes = {
        m.group(1): int(m.group(2))
        for m in re.finditer(r"publication=(full|adapter) bytes=(\d+) ", out)
    }
    assert set(sizes) == {"full", "adapter"}
    assert 0.05 < sizes["adapter"] / sizes["full"] < 0.15, sizes
    assert re.search(r"^publish_lora_vs_full_tiny=\d+\.\d\d$", out, re.M), out
