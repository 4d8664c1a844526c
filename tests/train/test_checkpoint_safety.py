"""Resuming never runs code from a checkpoint directory (docs/security.md): the DCP shards'
metadata is JSON, a pickled ``.metadata`` planted next to it is never opened (a payload that
would create a file does not), a manifest that lists one is refused, and a manifest missing
a field is a corrupt checkpoint (the previous one is used), not a ``KeyError``."""

from __future__ import annotations

import json
import os
import pickle

import pytest
import torch
import torch.distributed.checkpoint as dcp

from relayrl.models.loading import load_model, load_tokenizer
from relayrl.train.checkpoint import CheckpointStore, CheckpointWarning
from relayrl.train.dcp_json import (
    JSON_METADATA,
    JsonReader,
    metadata_from_json,
    metadata_to_json,
)
from relayrl.train.fsdp import load_sharded, save_sharded


class Payload:
    """Unpickling this creates ``path``: the proof that code ran."""

    def __init__(self, path: str) -> None:
        self.path = path

    def __reduce__(self):
        return (os.system, (f"touch {self.path}",))


@pytest.fixture(scope="module")
def model_and_tokenizer(tiny_model_dir):
    return load_model(tiny_model_dir), load_tokenizer(tiny_model_dir)


def model_and_optimizer(tiny_model_dir, seed: int):
    model = load_model(tiny_model_dir)
    torch.manual_seed(seed)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(0.01 * torch.randn_like(p))
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    model(torch.tensor([[5, 6, 7]])).logits.sum().backward()
    optimizer.step()
    return model, optimizer


def test_sharded_state_round_trips_through_json_metadata_only(tiny_model_dir, tmp_path):
    model, optimizer = model_and_optimizer(tiny_model_dir, seed=1)
    save_sharded(model, optimizer, tmp_path / "shards")
    names = {p.name for p in (tmp_path / "shards").iterdir()}
    assert JSON_METADATA in names and ".metadata" not in names  # no pickle written
    marker = tmp_path / "code-ran"
    with open(tmp_path / "shards" / ".metadata", "wb") as f:  # planted by an attacker
        pickle.dump(Payload(str(marker)), f)
    other, other_optimizer = model_and_optimizer(tiny_model_dir, seed=2)
    load_sharded(other, other_optimizer, tmp_path / "shards")
    assert not marker.exists()
    for (name, a), b in zip(model.state_dict().items(), other.state_dict().values(), strict=True):
        assert torch.equal(a, b), name
    saved, loaded = optimizer.state_dict(), other_optimizer.state_dict()
    assert saved["param_groups"] == loaded["param_groups"]
    for i, state in saved["state"].items():
        assert all(torch.equal(v, loaded["state"][i][k]) for k, v in state.items())


def test_json_metadata_equals_what_dcp_would_pickle_and_malformed_is_named(
    tiny_model_dir, tmp_path
):
    model, optimizer = model_and_optimizer(tiny_model_dir, seed=3)
    save_sharded(model, optimizer, tmp_path / "s")
    data = json.loads((tmp_path / "s" / JSON_METADATA).read_text())
    metadata = JsonReader(str(tmp_path / "s")).read_metadata()
    assert metadata_to_json(metadata) == data  # the document is all there is to it
    assert metadata.state_dict_metadata.keys() == dcp_keys(model, optimizer)
    bad = json.loads(json.dumps(data))
    bad["storage_data"][0]["path"] = "../../etc/passwd"
    with pytest.raises(ValueError, match="bad file name"):
        metadata_from_json(bad)
    bad = json.loads(json.dumps(data))
    first = next(iter(bad["state_dict_metadata"].values()))
    first.update(kind="tensor", dtype="os.system")
    with pytest.raises(ValueError, match="unknown dtype"):
        metadata_from_json(bad)


def dcp_keys(model, optimizer) -> set[str]:
    from torch.distributed.checkpoint._nested_dict import flatten_state_dict
    from torch.distributed.checkpoint.state_dict import get_state_dict

    model_state, optim_state = get_state_dict(model, optimizer)
    flat, _ = flatten_state_dict({"model": model_state, "optimizer": optim_state})
    return set(flat)


def write(store, step, model, tok):
    return store.write(step, model, tok, {"controller": {"step": step}}, {})


@pytest.mark.parametrize(
    ("damage", "expected"),
    [
        (lambda m: m.pop("step"), "step must be"),
        (lambda m: m.update(step="7"), "step must be"),
        (lambda m: m["files"]["model/config.json"].pop("bytes"), "no integer 'bytes'"),
        (lambda m: m["files"]["model/config.json"].pop("sha256"), "no 'sha256'"),
        (lambda m: m["files"].update({"../../x": {"bytes": 1, "sha256": "0"}}), "outside"),
        (lambda m: m["files"].update({"shards/.metadata": {"bytes": 1, "sha256": "0"}}), "pickled"),
    ],
)
def test_a_manifest_missing_a_field_falls_back_to_the_previous_checkpoint(
    tmp_path, model_and_tokenizer, damage, expected
):
    model, tok = model_and_tokenizer
    store = CheckpointStore(tmp_path / "ck", keep=3)
    for step in (1, 2):
        write(store, step, model, tok)
    path = tmp_path / "ck" / "step-000002" / "manifest.json"
    manifest = json.loads(path.read_text())
    damage(manifest)
    path.write_text(json.dumps(manifest))
    with pytest.warns(CheckpointWarning, match=expected):
        latest = store.latest()
    assert latest is not None and latest.step == 1


def test_an_old_checkpoint_with_pickled_shard_metadata_is_not_loaded(tmp_path, model_and_tokenizer):
    """A checkpoint whose manifest lists a DCP pickle (torch's own writer) is refused before
    anything is read, and the previous one is used."""
    model, tok = model_and_tokenizer
    store = CheckpointStore(tmp_path / "ck", keep=3)
    write(store, 1, model, tok)
    marker = tmp_path / "code-ran"

    def pickled_shards(directory):
        (directory / "shards").mkdir()
        with open(directory / "shards" / ".metadata", "wb") as f:
            pickle.dump(Payload(str(marker)), f)

    store.write(2, model, tok, {"controller": {"step": 2}}, {}, write_extra=pickled_shards)
    with pytest.warns(CheckpointWarning, match="pickled DCP metadata.*left it in place"):
        assert store.latest().step == 1
    assert not marker.exists()
    assert (tmp_path / "ck" / "step-000002").is_dir()  # an old run's, not deleted


def test_dcp_itself_would_have_run_the_payload(tiny_model_dir, tmp_path):
    """The control: torch's own reader unpickles ``.metadata`` (what resume did before)."""
    marker = tmp_path / "code-ran"
    (tmp_path / "s").mkdir()
    with open(tmp_path / "s" / ".metadata", "wb") as f:
        pickle.dump(Payload(str(marker)), f)
    with pytest.raises(Exception):  # noqa: B017 - the payload's return value is no Metadata
        dcp.FileSystemReader(str(tmp_path / "s")).read_metadata()
    assert marker.exists()
