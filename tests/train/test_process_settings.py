"""The trainer process's settings are applied in one place for a run: torch threads, the
GIL switch interval (restored afterwards) and library progress bars off, so a weight
publication's or evaluation's ``save_pretrained`` prints no "Writing model shards" bar
under relayrl's dashboard."""

from __future__ import annotations

import contextlib
import io
import sys

import torch
from transformers import LlamaConfig, LlamaForCausalLM
from transformers.utils import logging as hf_logging

from relayrl.config.loader import load_config
from relayrl.train.run.process import process_settings


def saved_output(model: torch.nn.Module, directory) -> str:
    err = io.StringIO()
    with contextlib.redirect_stderr(err):
        model.save_pretrained(directory)
    return err.getvalue()


def test_a_run_sets_threads_and_switch_interval_then_restores_it(tmp_path):
    config = load_config(None, ["train.trainer_threads=1", "train.switch_interval_ms=0.25"])
    before = sys.getswitchinterval()
    with process_settings(config):
        assert sys.getswitchinterval() == 0.25 / 1000
        assert torch.get_num_threads() == 1
    assert sys.getswitchinterval() == before


def test_no_progress_bar_when_a_run_saves_weights(tmp_path):
    shape = {"hidden_size": 16, "intermediate_size": 32, "num_hidden_layers": 1}
    model = LlamaForCausalLM(
        LlamaConfig(vocab_size=64, num_attention_heads=2, num_key_value_heads=2, **shape)
    )
    hf_logging.enable_progress_bar()  # as in a fresh process
    assert "Writing model shards" in saved_output(model, tmp_path / "before")
    with process_settings(load_config(None, ["train.trainer_threads=1"])):
        assert "Writing model shards" not in saved_output(model, tmp_path / "a")
    assert (tmp_path / "a" / "config.json").is_file()
