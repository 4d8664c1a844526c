"""Fixtures of the launch tests: one vLLM server shared by the modules that need one."""

from __future__ import annotations

import pytest

from tests.launch._vllm import vllm_servers


@pytest.fixture(scope="package")
def vllm_server(tiny_model_dir, tmp_path_factory):
    """One vLLM server over the tiny model for tests/launch/test_vllm_*.py (a start costs
    20-60 s here), stopped after the package's last test. Each test leaves it serving
    usable weights; a test that kills it gets a replacement from the supervisor, so read
    ``launcher.urls`` when needed, not once."""
    with vllm_servers(tiny_model_dir, tmp_path_factory.mktemp("vllm-logs")) as launcher:
        yield launcher
