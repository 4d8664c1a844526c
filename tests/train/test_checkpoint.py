"""The checkpoint store: atomic writes, keep-last-N, a corrupt or partial latest checkpoint is
detected and the previous one used, a failed write (disk full) leaves the previous intact."""

from __future__ import annotations

import errno
import json

import pytest
import torch

from relayrl.errors import RelayError
from relayrl.models.loading import load_model, load_tokenizer
from relayrl.train import checkpoint as ckpt_mod
from relayrl.train.checkpoint import CheckpointStore, CheckpointWarning, verify


@pytest.fixture(scope="module")
def model_and_tokenizer(tiny_model_dir):
    return load_model(tiny_model_dir), load_tokenizer(tiny_model_dir)


def write(store, step, model, tok):
    return store.write(
        step, model, tok, {"controller": {"step": step}}, {"trainer": {"v": torch.tensor([step])}}
    )


def test_write_keeps_last_n_and_the_model_loads_with_transformers(tmp_path, model_and_tokenizer):
    from transformers import AutoModelForCausalLM

    model, tok = model_and_tokenizer
    store = CheckpointStore(tmp_path / "ck", keep=2)
    for step in (2, 4, 6):
        write(store, step, model, tok)
    assert [s for s, _ in store.step_dirs()] == [6, 4]
    assert not list((tmp_path / "ck").glob(".tmp-*"))
    latest = store.latest()
    assert latest.step == 6
    assert latest.read_json("controller") == {"step": 6}
    assert latest.read_torch("trainer")["v"].tolist() == [6]
    manifest = json.loads((latest.path / "manifest.json").read_text())
    assert "model/model.safetensors" in manifest["files"]
    loaded = AutoModelForCausalLM.from_pretrained(latest.model_dir)
    want = model.state_dict()
    assert all(torch.equal(t, want[n]) for n, t in loaded.state_dict().items())


def test_corrupt_or_partial_latest_falls_back_to_the_previous(tmp_path, model_and_tokenizer):
    model, tok = model_and_tokenizer
    store = CheckpointStore(tmp_path / "ck", keep=3)
    for step in (1, 2, 3):
        write(store, step, model, tok)
    weights = tmp_path / "ck" / "step-000003" / "model" / "model.safetensors"
    data = bytearray(weights.read_bytes())
    data[len(data) // 2] ^= 0x01  # one flipped bit
    weights.write_bytes(bytes(data))
    (tmp_path / "ck" / "step-000002" / "manifest.json").unlink()  # a partial directory
    (tmp_path / "ck" / ".tmp-step-000004-1").mkdir()  # an interrupted write
    with pytest.warns(CheckpointWarning) as record:
        latest = store.latest()
    assert latest.step == 1
    messages = " ".join(str(w.message) for w in record)
    assert "step-000003" in messages and "sha256" in messages
    assert "step-000002" in messages and "no manifest" in messages
    assert [s for s, _ in store.step_dirs()] == [1]  # the unusable ones are removed
    write(store, 2, model, tok)  # the run goes on from step 1 and writes step 2 again
    assert not (tmp_path / "ck" / ".tmp-step-000004-1").exists()
    assert verify(tmp_path / "ck" / "step-000002").step == 2


def test_truncated_file_is_detected(tmp_path, model_and_tokenizer):
    model, tok = model_and_tokenizer
    store = CheckpointStore(tmp_path / "ck", keep=2)
    write(store, 1, model, tok)
    write(store, 2, model, tok)
    state = tmp_path / "ck" / "step-000002" / "trainer.pt"
    state.write_bytes(state.read_bytes()[:10])
    with pytest.warns(CheckpointWarning, match="trainer.pt: 10 bytes"):
        assert store.latest().step == 1


def test_disk_full_mid_write_is_a_clear_error_and_keeps_the_previous(
    tmp_path, model_and_tokenizer, monkeypatch
):
    model, tok = model_and_tokenizer
    store = CheckpointStore(tmp_path / "ck", keep=2)
    write(store, 1, model, tok)
    real = ckpt_mod._write_bytes
    calls = []

    def full_disk(path, data):
        calls.append(path)
        if len(calls) == 2:  # the first state went through, the second finds the disk full
            raise OSError(errno.ENOSPC, "No space left on device", str(path))
        real(path, data)

    monkeypatch.setattr(ckpt_mod, "_write_bytes", full_disk)
    with pytest.raises(RelayError) as err:
        write(store, 2, model, tok)
    message = str(err.value)
    assert "step-000002" in message and "No space left on device" in message
    assert "previous checkpoint step-000001 is intact" in message and "--resume" in message
    assert [s for s, _ in store.step_dirs()] == [1]
    assert not list((tmp_path / "ck").glob(".tmp-*"))
    assert store.latest().read_json("controller") == {"step": 1}


def test_state_that_is_not_json_names_the_component(tmp_path, model_and_tokenizer):
    model, tok = model_and_tokenizer
    store = CheckpointStore(tmp_path / "ck", keep=2)
    with pytest.raises(RelayError, match="'replay' is not JSON-serialisable"):
        store.write(1, model, tok, {"replay": {"x": object()}}, {})
    assert store.step_dirs() == []
