"""How `make test` shares the suite between two pytest-xdist workers on a 2-core machine.

Tests are handed out one at a time (most leave one of the two cores idle: a heavy test on
one worker then runs beside light ones on the other), but for files that share one expensive
resource: those form one unit of work and run on one worker, one after the other. The launch
tests' vLLM server is package-scoped (one start for the files that use it; two servers at
once also slow each other's timed checks), and the Ray clusters of the Ray tests share Ray's
default ports. The vLLM unit, the longest, is handed out first; the other worker meanwhile
takes the long tests (``LONG``), so that neither worker ends long after the other (the
suite's last minutes were one long test on one worker while the other idled); the rest
follow in collection order. (xdist's own ``--dist loadgroup`` marks do not group under pytest 9: it
renames ``item._nodeid``, which pytest 9 no longer reads.)
"""

from __future__ import annotations

import pytest
from xdist.scheduler import LoadScopeScheduling

SHARED_RESOURCE_GROUPS = {
    "vllm": ("tests/launch/test_vllm_", "tests/launch/test_port_squatting.py"),
    "ray": ("tests/launch/test_ray_",),
}


def unit_of(nodeid: str) -> str:
    """The unit of work a test belongs to: its resource group, else the test alone."""
    path = nodeid.split("::", 1)[0]
    for group, prefixes in SHARED_RESOURCE_GROUPS.items():
        if path.startswith(prefixes):
            return group
    return nodeid


# units of about 20 s or more under `make test` (pytest --durations), longest first
LONG = (
    "tests/train/test_improves.py",
    "tests/test_your_own_doc.py",
    "ray",
    "tests/train/test_resume_kill.py",
    "tests/train/test_fsdp.py",
    "tests/train/test_lora_fsdp.py",
    "tests/rewards/test_code.py",
    "tests/train/test_train_failures.py",
    "tests/launch/test_server_keys.py",
    "tests/train/test_rendezvous_store.py",
    "tests/train/test_resume_kill_episodes.py",
    "tests/launch/test_server_restart.py",
    "tests/test_plugins.py",
    "tests/sync/test_broadcast.py",
    "tests/train/test_lora.py",
    "tests/train/test_eval_servers.py",
)


def long_first(items: list[pytest.Item]) -> list[pytest.Item]:
    """``items`` with the vLLM unit's tests first, then those of ``LONG`` in its order, then
    the rest (a stable sort: every test keeps its place within its file or unit)."""
    rank = {unit: i for i, unit in enumerate(("vllm", *LONG))}

    def key(item: pytest.Item) -> int:
        unit = unit_of(item.nodeid)
        return rank.get(unit, rank.get(unit.split("::", 1)[0], len(rank)))

    return sorted(items, key=key)


class SharedResourceScheduling(LoadScopeScheduling):
    """xdist's load-by-scope scheduling with ``unit_of`` as the scope, in collection order."""

    def __init__(self, config: pytest.Config, log=None) -> None:
        super().__init__(config, log)
        config.option.loadscopereorder = False  # keep long_first's order

    def _split_scope(self, nodeid: str) -> str:
        return unit_of(nodeid)
