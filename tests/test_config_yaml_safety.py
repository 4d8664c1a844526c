"""Config YAML that would hang or exhaust the machine is one ``error:`` line, fast: the
"billion laughs" alias map (``relayrl config --config bomb.yaml`` hung with no output),
through ``--resume`` too (it reads a run directory's config.yaml), anchors and merge keys,
a file too large or nested too deeply to be a config."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from relayrl.config.loader import load_config
from relayrl.errors import RelayError

ROOT = Path(__file__).resolve().parents[1]

BOMB = "\n".join(
    ['a: &a ["lol","lol","lol","lol","lol","lol","lol","lol","lol"]']
    + [f"{chr(98 + i)}: &{chr(98 + i)} [{','.join(['*' + chr(97 + i)] * 9)}]" for i in range(8)]
    + ["name: *i"]
)


def relayrl(*args: str, timeout: float = 60) -> subprocess.CompletedProcess:
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    cmd = [sys.executable, "-m", "relayrl.cli", *args]
    return subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, env=env)


def test_a_yaml_bomb_is_one_error_line_naming_the_file_and_line(tmp_path):
    bomb = tmp_path / "bomb.yaml"
    bomb.write_text(BOMB + "\n")
    start = time.monotonic()
    out = relayrl("config", "--config", str(bomb))
    assert time.monotonic() - start < 30
    assert out.returncode != 0
    lines = out.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: "), out.stderr
    assert f"{bomb}:1:" in lines[0] and "anchors and aliases" in lines[0]


def test_resume_reads_the_run_config_through_the_same_loader(tmp_path):
    run = tmp_path / "run"
    run.mkdir()
    (run / "config.yaml").write_text(BOMB + "\n")
    out = relayrl("train", "--resume", str(run))
    lines = out.stderr.strip().splitlines()
    assert out.returncode != 0 and len(lines) == 1, out.stderr
    assert lines[0].startswith("error: ") and "config.yaml:1:" in lines[0]


@pytest.mark.parametrize(
    ("text", "line"),
    [
        ("model:\n  path: &p /m\nname: *p\n", 2),
        ("base: &b {lr: 1}\noptim:\n  <<: *b\n", 1),
        ("optim:\n  lr: 1.0e-3\nsft: !!python/object/apply:os.system [true]\n", 3),
    ],
)
def test_anchors_merges_and_tags_are_refused_at_their_line(tmp_path, text, line):
    path = tmp_path / "c.yaml"
    path.write_text(text)
    with pytest.raises(RelayError, match=rf"c.yaml:{line}: "):
        load_config(path)


def test_too_large_or_too_deep_is_refused(tmp_path):
    big = tmp_path / "big.yaml"
    big.write_text("# " + "x" * (2 << 20) + "\n")
    with pytest.raises(RelayError, match="bytes; a run config is at most"):
        load_config(big)
    deep = tmp_path / "deep.yaml"
    deep.write_text("name: " + "[" * 5000 + "]" * 5000 + "\n")
    with pytest.raises(RelayError, match="deep.yaml"):
        load_config(deep)


def test_an_override_with_an_alias_is_refused():
    with pytest.raises(RelayError, match="anchors and aliases"):
        load_config(None, ["name=&x a"])


def test_a_key_given_twice_is_an_error_at_its_second_line(tmp_path):
    """YAML keeps the last of two equal keys silently: a harmless ``plugins: []`` at the top
    of a run directory's config.yaml could be overridden by a later ``plugins: [...]``."""
    from relayrl.config.loader import load_config
    from relayrl.errors import RelayError

    path = tmp_path / "config.yaml"
    path.write_text("name: a\nplugins: []\nrollout:\n  eta: 2\nplugins: [evil_module]\n")
    with pytest.raises(RelayError, match=r"config.yaml:5: .*key .plugins. appears twice"):
        load_config(path)
    path.write_text("rollout:\n  eta: 2\n  eta: 3\n")
    with pytest.raises(RelayError, match=r"config.yaml:3: .*key 'eta' appears twice"):
        load_config(path)
