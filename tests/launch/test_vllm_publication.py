"""A vLLM server SIGKILLed in the middle of a publication, twice: once paused before its
load (mid-load), once after the load and the version label, before its resume (mid-resume).
Each time the publication's step fails as an unreachable server, the supervisor restarts
it (the replacement loads the newest disk snapshot) and repeats the whole transaction; the
publication ends verified (version and checksum) and with the server resumed: it is not
paused and it generates tokens of the published version.

About 3 minutes on the 2-core CPU (a vLLM start, then two restarts): `pytest -m benchmark`
runs it; the suite's kill of a broadcast publication is
tests/launch/test_vllm_broadcast.py."""

from __future__ import annotations

import asyncio
import os
import signal

import pytest

from relayrl.engine.vllm_client import VLLMClient
from relayrl.launch.supervisor import ServerSupervisor
from relayrl.models.loading import load_model
from relayrl.sync.canary import Canary
from relayrl.sync.transports import DiskPublisher, ModelSource
from relayrl.sync.weight_sync import WeightSync
from tests.launch._vllm import needs_vllm, perturbed, vllm_servers

pytestmark = [needs_vllm, pytest.mark.benchmark]


class Listener:
    def __init__(self) -> None:
        self.versions: list[int] = []

    def set_published_version(self, version: int) -> None:
        self.versions.append(version)

    def fail(self, exc: BaseException) -> None:
        raise AssertionError(f"the publication failed: {exc}")


def test_a_vllm_server_killed_mid_load_and_mid_resume(tiny_model_dir, tmp_path):
    kills: list[str] = []
    moment = {"at": ""}  # which call kills the server next: "load" or "resume"
    rpc, tag = VLLMClient._rpc, VLLMClient._tag

    def kill_if(at: str, launcher) -> None:
        if moment["at"] == at:
            moment["at"] = ""
            os.killpg(launcher.pids[0], signal.SIGKILL)
            kills.append(at)

    with vllm_servers(tiny_model_dir, tmp_path / "logs") as launcher:

        async def killing_rpc(self, url, method, kwargs):
            kill_if("load", launcher)  # paused, nothing loaded yet
            return await rpc(self, url, method, kwargs)

        async def killing_tag(self, version, urls):
            result = await tag(self, version, urls)
            kill_if("resume", launcher)  # loaded and labelled, not resumed
            return result

        async def main():
            VLLMClient._rpc, VLLMClient._tag = killing_rpc, killing_tag
            try:
                async with VLLMClient(launcher.urls, timeout=120) as client:
                    publisher = DiskPublisher()
                    supervisor = ServerSupervisor(launcher, client, 2)
                    listener = Listener()
                    publication = WeightSync(
                        supervisor, publisher, tmp_path / "w", listener, Canary(every=1)
                    )
                    policy = load_model(tiny_model_dir)
                    for version, at in ((1, "load"), (2, "resume")):
                        moment["at"] = at
                        source = ModelSource(perturbed(policy, seed=version))
                        await publication.submit(source, version, wait=True)
                    url = client.urls[0]
                    paused = await client._request("GET", url, "/is_paused")
                    out = await client.generate([5, 6, 7], {"max_new_tokens": 4, "seed": 1})
                    return supervisor.restarts, listener.versions, paused, out
            finally:
                VLLMClient._rpc, VLLMClient._tag = rpc, tag

        restarts, versions, paused, out = asyncio.run(main())
    assert kills == ["load", "resume"] and restarts == 2
    assert versions == [1, 2]  # both verified (checksum, version) and canaried
    assert paused == {"is_paused": False}
    assert out.output_versions == [2] * 4
