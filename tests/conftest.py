"""Shared fixtures. Tests run on 2 shared cores: one torch thread per process."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

torch.set_num_threads(1)

SHARED_DATA = Path(__file__).resolve().parents[2] / "shared" / "data"


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory) -> Path:
    """A randomly initialised 'tiny' Qwen3 model + task tokenizer saved as an HF directory."""
    from relayrl.models.build import create_model_dir
    from relayrl.tasks.registry import make_task

    out = tmp_path_factory.mktemp("tiny_model")
    create_model_dir(out, make_task("arithmetic"), "tiny", seed=0, corpus_size=500)
    return out


@pytest.fixture(scope="session")
def shared_data() -> Path:
    """The real benchmark files in ../shared/data (never committed into the project)."""
    if not SHARED_DATA.is_dir():
        pytest.fail(f"expected the shared benchmark data at {SHARED_DATA}")
    return SHARED_DATA
