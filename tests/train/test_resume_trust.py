"""``relayrl train --resume RUN_DIR`` reads the run directory's config.yaml: a run directory
is data (copied from a colleague, downloaded), and its config could import a plugin, switch
the code sandbox off or point the vLLM servers at any interpreter (issue 43, item 3). Those
keys are refused, naming the line, unless the command line says them again; nothing in the
file runs before that."""

from __future__ import annotations

import json

import pytest

from relayrl.errors import RelayError
from relayrl.train.resume.run_start import resume_config


def write_run(tmp_path, text: str):
    run = tmp_path / "runs" / "shared_run"
    run.mkdir(parents=True)
    (run / "config.yaml").write_text(text)
    return run


def test_a_plugin_in_a_run_directory_does_not_run_unless_confirmed(tmp_path):
    marker = tmp_path / "ran"
    plugin = tmp_path / "evil.py"
    plugin.write_text(f"open({str(marker)!r}, 'w').write('pwned')\n")
    run = write_run(tmp_path, f"name: shared_run\nrollout:\n  eta: 2\nplugins: [{plugin}]\n")
    with pytest.raises(RelayError, match=r"config.yaml:4: plugins: .*evil.py.* not trusted"):
        resume_config(run, [])
    assert not marker.exists()
    config = resume_config(run, [f"plugins={json.dumps([str(plugin)])}"])
    assert marker.exists() and config.rollout.eta == 2


@pytest.mark.parametrize(
    ("text", "where"),
    [
        ("sandbox:\n  allow_unisolated: true\n", "2: sandbox.allow_unisolated"),
        ("rollout:\n  vllm:\n    python: /tmp/anything\n", "3: rollout.vllm.python"),
    ],
)
def test_the_sandbox_switch_and_the_vllm_interpreter_need_confirming(tmp_path, text, where):
    run = write_run(tmp_path, text)
    with pytest.raises(RelayError, match=f"config.yaml:{where}: "):
        resume_config(run, [])


def test_harmless_values_need_nothing(tmp_path):
    run = write_run(tmp_path, "plugins: []\nsandbox:\n  allow_unisolated: false\n")
    assert resume_config(run, []).plugins == []
