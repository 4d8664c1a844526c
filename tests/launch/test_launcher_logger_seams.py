"""The launcher and metric-logger seams: the built-in launchers answer what used to be
``launcher == "ray"`` branches, and the example of docs/extending.md, imported as a module
of its own, registers a launcher and a logger that the config accepts (and suggests for a
typo) and a short run launches and logs through."""

from __future__ import annotations

import os
import shutil
import sys
from pathlib import Path

import pytest

from relayrl.config.loader import load_config
from relayrl.errors import RelayError
from relayrl.launch.launchers import LocalLauncher, RayLauncher, make_launcher, register_launcher
from relayrl.launch.ray_cluster import RayServerLauncher
from relayrl.launch.servers import ServerLauncher
from relayrl.registry import LAUNCHERS, LOGGERS, load_path
from relayrl.report.logs import read_jsonl
from relayrl.train.distributed import available_cores, check_trainer_ranks
from relayrl.train.loggers import register_logger, scalars
from relayrl.train.ray_ranks import RayWorkerRanks
from relayrl.train.run import run_train
from relayrl.train.run.job import weights_root
from relayrl.train.worker_ranks import WorkerRanks
from tests.doc_examples import import_doc_example
from tests.train.conftest import parity_grader, rl_config

SECTION = "## A launcher and a metric logger"


def launcher_of(*overrides: str):
    return make_launcher(load_config(None, list(overrides)))


def test_the_builtin_launchers_place_servers_and_ranks():
    local = launcher_of("train.world_size=3", "rollout.num_servers=2")
    ray = launcher_of("launcher=ray", "train.world_size=3", "rollout.num_servers=2")
    assert (type(local), type(ray)) == (LocalLauncher, RayLauncher)
    assert (local.ranks_here(), ray.ranks_here()) == (3, 1)  # Ray places ranks 1 and 2
    assert load_path(local.trainer_ranks) is WorkerRanks
    assert load_path(ray.trainer_ranks) is RayWorkerRanks
    servers = local.server_launcher("spec", Path("logs"))
    assert type(servers) is ServerLauncher
    assert (servers.spec, servers.num_servers, servers.log_dir) == ("spec", 2, Path("logs"))
    on_ray = ray.server_launcher("spec", None)
    assert type(on_ray) is RayServerLauncher and on_ray.ray_config == ray.config.ray
    assert (on_ray.num_servers, on_ray.mode) == (2, ray.config.rollout.server_mode)
    assert not local.spans_nodes() and not ray.spans_nodes()  # ray.address=local: this node
    assert launcher_of("launcher=ray", "ray.address=auto").spans_nodes()


class ElsewhereLauncher(LocalLauncher):
    """A launcher whose servers may sit on other nodes (as a Slurm or Kubernetes one would)."""

    name = "elsewhere"

    def spans_nodes(self) -> bool:
        return True


@pytest.mark.skipif(not os.access("/dev/shm", os.W_OK), reason="no writable tmpfs here")
def test_published_weights_leave_tmpfs_when_the_launcher_spans_nodes(tmp_path):
    """Where published weights go asks the launcher (``spans_nodes``), not whether it is
    named ``ray``: node-local /dev/shm for servers on this node, the run directory (shared)
    for a plugin launcher's servers elsewhere, as for Ray with a cluster address."""
    register_launcher(ElsewhereLauncher)
    run = tmp_path / "run"
    base = [f"output_dir={tmp_path}", "name=run"]
    roots = {}
    try:
        for launcher in (["launcher=local"], ["launcher=elsewhere"], ["launcher=ray"]):
            roots[launcher[0]] = weights_root(load_config(None, [*base, *launcher]), run)
        clustered = [*base, "launcher=ray", "ray.address=auto"]
        roots["ray on a cluster"] = weights_root(load_config(None, clustered), run)
    finally:
        LAUNCHERS.pop("elsewhere", None)
        for root in roots.values():
            shutil.rmtree(root)
    assert {name: root.parent for name, root in roots.items()} == {
        "launcher=local": Path("/dev/shm"),
        "launcher=elsewhere": run,
        "launcher=ray": Path("/dev/shm"),  # ray.address=local: this node
        "ray on a cluster": run,
    }


def test_launcher_environment_checks(monkeypatch):
    assert launcher_of().check_environment() is None
    monkeypatch.setitem(sys.modules, "ray", None)  # what Python does for a missing module
    with pytest.raises(RelayError, match=r"ray does not import .*pip install 'ray\[default\]'"):
        launcher_of("launcher=ray").check_environment()


def test_the_trainer_ranks_check_counts_the_ranks_this_node_holds():
    """N = 2 ranks of all the cores each: too many for one node, fine when Ray places rank 1."""
    threads = available_cores()
    sizes = ("train.world_size=2", f"train.trainer_threads={threads}")
    with pytest.raises(RelayError, match=f"needs {2 * threads} cores here"):
        check_trainer_ranks(load_config(None, list(sizes)))
    check_trainer_ranks(load_config(None, ["launcher=ray", *sizes]))


def test_unknown_launchers_and_loggers_name_the_registered_ones():
    with pytest.raises(RelayError, match=r"unknown launcher 'rey' \(did you mean 'ray'\?\)"):
        load_config(None, ["launcher=rey"])
    with pytest.raises(RelayError, match=r"unknown metric logger 'wandbb' \(did you mean"):
        load_config(None, ["train.loggers=[tensorboard, wandbb]"])
    with pytest.raises(RelayError, match="launcher=ray needs rollout.lag=async"):
        load_config(None, ["launcher=ray", "rollout.lag=fixed"])


def test_only_subclasses_register():
    class Loose:
        name = "loose"

    with pytest.raises(TypeError, match="a launcher must subclass Launcher"):
        register_launcher(Loose)  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="a metric logger must subclass MetricSink"):
        register_logger(Loose)  # type: ignore[arg-type]
    assert "loose" not in LAUNCHERS and "loose" not in LOGGERS


@pytest.fixture(scope="module")
def plugin(tmp_path_factory):
    """The documented block, written to a file outside the package and imported."""
    directory = tmp_path_factory.mktemp("plugin")
    yield import_doc_example("extending.md", SECTION, directory, "relayrl_launcher_example")
    LAUNCHERS.pop("counting_local", None)
    LOGGERS.pop("memory", None)
    sys.modules.pop("relayrl_launcher_example", None)


def test_the_config_takes_the_registered_names_and_suggests_them(plugin, tmp_path):
    config = rl_config(tmp_path, tmp_path, "launcher=counting_local", "train.loggers=[memory]")
    assert (config.launcher, config.train.loggers) == ("counting_local", ["memory"])
    assert type(make_launcher(config)) is plugin.CountingLauncher
    with pytest.raises(RelayError, match="did you mean 'counting_local'"):
        rl_config(tmp_path, tmp_path, "launcher=counting_locl")
    with pytest.raises(RelayError, match="did you mean 'memory'"):
        rl_config(tmp_path, tmp_path, "train.loggers=[memry]")


def test_a_run_launches_and_logs_through_the_plugins(plugin, tmp_path, tiny_model_dir):
    """2 steps: the servers through CountingLauncher (once), and every numeric metric of
    metrics.jsonl through MemorySink, step by step."""
    plugin.CountingLauncher.built = 0
    config = rl_config(
        tmp_path,
        tiny_model_dir,
        "launcher=counting_local",
        "train.loggers=[memory]",
        "train.total_steps=2",
        "rollout.eta=0",
    )
    run_train(config, grader=parity_grader)
    assert plugin.CountingLauncher.built == 1
    rows = read_jsonl(tmp_path / "run" / "metrics.jsonl")
    assert plugin.MemorySink.rows == [(row["step"], scalars(row)) for row in rows]
    assert {step for step, _ in plugin.MemorySink.rows} == {1, 2}
