"""The rollout-backend and weight-transport seams used from outside the package: the example
of docs/extending.md, imported as a module of its own, registers a backend and a transport;
the config accepts their names (and suggests them for a typo), and a short run generates
through the backend's client and publishes through the transport."""

from __future__ import annotations

import collections
import json
import sys

import pytest

from relayrl.errors import RelayError
from relayrl.registry import ROLLOUT_BACKENDS, WEIGHT_TRANSPORTS, Registry
from relayrl.sync.transports import DiskPublisher
from relayrl.train.run import run_train
from tests.doc_examples import import_doc_example
from tests.train.conftest import parity_grader, rl_config

SECTION = "## A rollout backend and a weight transport"


@pytest.fixture(scope="module")
def plugin(tmp_path_factory):
    """The documented block, written to a file outside the package and imported."""
    directory = tmp_path_factory.mktemp("plugin")
    yield import_doc_example("extending.md", SECTION, directory, "relayrl_plugin_example")
    ROLLOUT_BACKENDS.pop("counting", None)
    WEIGHT_TRANSPORTS.pop("logged_disk", None)
    sys.modules.pop("relayrl_plugin_example", None)


def test_the_config_takes_the_registered_names_and_suggests_them(plugin, tmp_path):
    config = rl_config(
        tmp_path, tmp_path, "rollout.engine=counting", "train.weight_transport=logged_disk"
    )
    assert (config.rollout.engine, config.train.weight_transport) == ("counting", "logged_disk")
    assert ROLLOUT_BACKENDS.lookup("counting") is plugin.CountingBackend
    assert WEIGHT_TRANSPORTS.lookup("logged_disk") is plugin.LoggedDisk
    with pytest.raises(RelayError, match="did you mean 'counting'"):
        rl_config(tmp_path, tmp_path, "rollout.engine=countin")
    with pytest.raises(RelayError, match="did you mean 'logged_disk'"):
        rl_config(tmp_path, tmp_path, "train.weight_transport=loged_disk")


def test_a_run_generates_and_publishes_through_the_plugins(plugin, tmp_path, tiny_model_dir):
    """3 steps at η = 0: every batch's groups through CountingClient.generate_many, and
    versions 1 and 2 loaded through LoggedDisk (the last step publishes nothing)."""
    plugin.CountingClient.calls, plugin.LoggedDisk.loaded = 0, []
    config = rl_config(
        tmp_path,
        tiny_model_dir,
        "rollout.engine=counting",
        "train.weight_transport=logged_disk",
        "rollout.eta=0",
    )
    result = run_train(config, grader=parity_grader)
    assert plugin.LoggedDisk.loaded == [1, 2]
    # 2 prompts per step, one batched call per group: at least the 6 trained groups
    assert plugin.CountingClient.calls >= 6
    summary = json.loads((tmp_path / "run" / "train_summary.json").read_text())
    assert summary["weight_transport"] == "logged_disk" == result.summary["weight_transport"]
    assert summary["rollout_engine"] == "counting"


def test_a_registry_entry_named_by_path_loads_on_lookup_and_yields_to_its_class():
    """Built-in backends and transports are named by import path, so the config can check
    names without importing relayrl.launch; the first lookup imports the class, and the
    module registering the class itself is no clash."""
    registry: Registry[object] = Registry("thing")
    registry.add_path("ordered", "collections:OrderedDict")
    assert registry.check("ordered") == "ordered"
    assert registry.lookup("ordered") is collections.OrderedDict
    registry.add_path("later", "relayrl.sync.transports.disk:DiskPublisher")
    registry.add("later", DiskPublisher)  # what @register_transport does on import: no clash
    assert registry["later"] is DiskPublisher
    with pytest.raises(ValueError, match="did you mean 'ordered'"):
        registry.check("orderd")
    with pytest.raises(ValueError, match="already registered"):
        registry.add("ordered", dict)
