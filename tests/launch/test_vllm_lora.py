"""LoRA on the vLLM backend (docs/lora.md "vLLM"): vLLM's CPU build serves dynamic LoRA
adapters, so an adapter publication is the adapter only, loaded in place as vLLM's LoRA
adapter with the base weights untouched.

* the PEFT directory relayrl writes for an adapter snapshot is what ``peft`` loads: the same
  logits as the trainer's LoRA model (no vLLM needed);
* the launcher starts vLLM with its LoRA flags for ``model.lora``;
* against a REAL vLLM server (started once for this module with ``model.lora``): adapter
  publications pass verify and the canary, the server's behaviour logprobs under the
  adapter equal the trainer's LoRA model's, and base requests still see the base; a client
  that loads the adapter but never names it in its requests (the adapter not applied, as in
  verl#7495) fails the canary naming the server and the version; adapter publications landing
  while requests decode: with ``abort`` every token's logprob is that of base + the adapter
  its version names (this fails without the worker extension's ``relayrl_lora_setup``),
  with ``keep`` the versions are ordered;
* ``relayrl train ... model.lora.r=8 rollout.engine=vllm`` at η = 0 and 2 trains, every
  publication adapter-only and verified, engine-vs-trainer KL at vLLM's tolerance.
"""

from __future__ import annotations

import asyncio
import json

import pytest
import torch

from relayrl.config.schema import LoraConfig, TrainConfig
from relayrl.engine.adapter import (
    ADAPTER_FILE,
    AdapterBase,
    load_partial,
    peft_dir,
    read_adapter,
)
from relayrl.engine.vllm_client import VLLMClient
from relayrl.launch.backends import make_backend
from relayrl.launch.supervisor import ServerSupervisor
from relayrl.models.loading import load_model
from relayrl.sync.canary import Canary
from relayrl.sync.transaction import PublicationError
from relayrl.sync.transports import make_publisher
from relayrl.sync.weight_sync import WeightSync
from tests.launch._vllm import (
    MAX_LOGPROB_DIFF,
    MAX_MEAN_K3,
    count_spanning_and_check_versions,
    needs_vllm,
    prompts,
    recompute,
    short_run_config,
    vllm_config,
    vllm_servers,
)
from tests.sync.test_adapter_publication import LoraSource
from tests.sync.test_publication import Listener

LORA = ("model.lora.r=4", "model.lora.alpha=8")


def test_the_peft_directory_is_what_peft_loads(tiny_model_dir, tmp_path):
    from peft import PeftModel

    source = LoraSource(tiny_model_dir, seed=5)
    snapshot = source.save_weights(tmp_path / "v1")
    directory = peft_dir(snapshot)
    assert directory.parent == snapshot and directory.name.startswith("peft-")
    assert peft_dir(snapshot) == directory  # written once, content-addressed
    config = json.loads((directory / "adapter_config.json").read_text())
    assert config["r"] == 4 and config["lora_alpha"] == 8.0  # alpha / r = the scale, 2
    loaded = PeftModel.from_pretrained(load_model(tiny_model_dir), str(directory)).eval()
    ids = torch.tensor([prompts(1, seed=0)[0]])
    with torch.no_grad():
        expected, got = source.model.eval()(ids).logits, loaded(ids).logits
    torch.testing.assert_close(got, expected, rtol=0, atol=1e-5)
    assert not torch.allclose(load_model(tiny_model_dir)(ids).logits, expected, atol=1e-3)
    (snapshot / ADAPTER_FILE).write_bytes(b"")  # another adapter: another directory
    with pytest.raises(Exception, match="adapter snapshot"):
        peft_dir(snapshot)


def test_the_launcher_starts_vllm_with_its_lora_flags(tiny_model_dir):
    config = vllm_config(tiny_model_dir, "model.lora.r=12", "rollout.eta=2")
    spec = make_backend(config, tiny_model_dir).server_spec()
    spec.api_key = "k"
    cmd = spec.command(8000)
    at = cmd.index("--enable-lora")
    assert cmd[at : at + 5] == ["--enable-lora", "--max-loras", "3", "--max-lora-rank", "16"]
    assert spec.environment(0)["VLLM_ALLOW_RUNTIME_LORA_UPDATING"] == "True"
    plain = make_backend(vllm_config(tiny_model_dir), tiny_model_dir).server_spec()
    plain.api_key = "k"
    assert "--enable-lora" not in plain.command(8000)
    assert "VLLM_ALLOW_RUNTIME_LORA_UPDATING" not in plain.environment(0)


@pytest.fixture(scope="module")
def lora_server(tiny_model_dir, tmp_path_factory):
    """A vLLM server over the tiny model serving LoRA adapters (``model.lora``)."""
    with vllm_servers(tiny_model_dir, tmp_path_factory.mktemp("vllm-lora"), *LORA) as launcher:
        yield launcher


def publish_two(launcher, tiny_model_dir, tmp_path, listener):
    """Two adapter publications through the publication transaction (verify, and the canary
    at tolerance 1e-4 on both); the canaries, their largest |Δ| and the client's adapter."""
    publisher = make_publisher(TrainConfig(weight_transport="disk"))

    async def main():
        keys = launcher.client_keys()
        async with VLLMClient(launcher.urls, timeout=120, lora=True, **keys) as client:
            supervisor = ServerSupervisor(launcher, client, 0)
            canary = Canary(every=1, tolerance=1e-4)
            publication = WeightSync(supervisor, publisher, tmp_path / "w", listener, canary)
            for version in (1, 2):
                await publication.submit(LoraSource(tiny_model_dir, version), version, wait=True)
                if listener.failure is not None:
                    break
            return publication.canaries, publication.canary_max_diff, client._adapters

    return asyncio.run(main())


async def sample(client, prompt, seed, lora):
    client.lora = lora
    params = {"max_new_tokens": 12, "temperature": 1.0, "seed": seed, "ignore_eos": True}
    return await client.generate(prompt, params)


@needs_vllm
def test_adapter_publications_are_served_exactly(lora_server, tiny_model_dir, tmp_path):
    listener = Listener()
    canaries, max_diff, adapters = publish_two(lora_server, tiny_model_dir, tmp_path, listener)
    assert listener.failure is None and listener.versions == [1, 2]
    assert canaries == 2 and max_diff < 1e-4, max_diff
    snapshot = tmp_path / "w" / "v2"
    assert adapters == {url: str(peft_dir(snapshot)) for url in lora_server.urls}
    assert read_adapter(snapshot).pairs  # adapter-only: no full weights were written
    assert not list(snapshot.glob("model*.safetensors"))

    base = load_model(tiny_model_dir).eval()
    trained = load_model(tiny_model_dir).eval()  # the base with v2's adapter merged
    load_partial(trained, AdapterBase().merged_state(trained, read_adapter(snapshot)))

    async def main():
        keys = lora_server.client_keys()
        async with VLLMClient(lora_server.urls, timeout=120, lora=True, **keys) as client:
            outs = []
            for i, prompt in enumerate(prompts(4, seed=1)):
                outs.append((prompt, await sample(client, prompt, i, True), trained))
                outs.append((prompt, await sample(client, prompt, i, False), base))
            return outs

    for prompt, out, model in asyncio.run(main()):
        assert out.output_versions == [2] * len(out.output_ids)
        expected = recompute(model, prompt, out.output_ids, 1.0)
        diff = (torch.tensor(out.output_logprobs) - expected).abs().max().item()
        assert diff < MAX_LOGPROB_DIFF, diff


@needs_vllm
def test_an_adapter_not_applied_fails_the_canary(
    lora_server, tiny_model_dir, tmp_path, monkeypatch
):
    """The server loads the adapter, but requests never name it: they sample the base."""
    monkeypatch.setattr(VLLMClient, "_with_adapter", lambda self, body: body)
    listener = Listener()
    publish_two(lora_server, tiny_model_dir, tmp_path, listener)
    assert listener.versions == []
    error = listener.failure
    assert isinstance(error, PublicationError) and error.step == "canary", error
    assert error.version == 1 and error.servers == lora_server.urls
    assert "it serves the base model, not the published LoRA adapter" in str(error)


def merged(model_dir, snapshot):
    """The base model with the adapter of ``snapshot`` merged (what the trainer serves)."""
    model = load_model(model_dir).eval()
    load_partial(model, AdapterBase().merged_state(model, read_adapter(snapshot)))
    return model


@needs_vllm
@pytest.mark.parametrize("mode", ["abort", "keep"])
def test_adapter_publications_interrupt_requests_exactly(
    lora_server, tiny_model_dir, tmp_path, mode
):
    """The vLLM interruption test (test_vllm_backend.py) with adapter publications: while 32
    requests decode, adapters v1, v2, ... are published one after another; every request
    ends with exactly its budget, its versions never go down, some span versions, and
    (abort-and-resubmit) each token's logprob is that of the base + the adapter its version
    names. ``keep``: running requests continue under the new adapter with their KV (only
    the version tags are checked, as for full weights)."""
    from tests.launch.test_vllm_backend import ATTEMPTS, BUDGET, DecodePacer, submit

    publications = 8
    snapshots = {
        v: LoraSource(tiny_model_dir, v).save_weights(tmp_path / f"v{v}")
        for v in range(1, publications + 1)
    }
    models = {0: load_model(tiny_model_dir).eval()}
    models |= {v: merged(tiny_model_dir, path) for v, path in snapshots.items()}
    batch = prompts(32, seed=4)
    params = [{"max_new_tokens": BUDGET, "seed": i, "ignore_eos": True} for i in range(32)]
    base_dir = str(tiny_model_dir)

    async def go():
        keys = lora_server.client_keys()
        async with VLLMClient(lora_server.urls, timeout=120, lora=True, **keys) as client:
            await client.update_weights(base_dir, 0, keep_kv=mode == "keep")  # the base, v0
            pacer = DecodePacer(lora_server.urls[0])
            tasks = submit(client, batch, params, grouped=False)
            for version in range(1, publications + 1):
                if not await pacer.until_decoding(tasks):
                    break
                await client.update_weights(
                    str(snapshots[version]), version, keep_kv=mode == "keep"
                )
            gens = [g for out in await asyncio.gather(*tasks) for g in out]
            await client.update_weights(base_dir, version=0)
            return gens

    for _ in range(ATTEMPTS):  # every attempt's versions and logprobs are checked
        gens = asyncio.run(go())
        spanning = count_spanning_and_check_versions(batch, gens, models, mode, BUDGET)
        print(f"{mode}: {spanning}/{len(batch)} requests span adapter versions")
        if spanning:
            break
    assert spanning > 0, f"no request was interrupted in {ATTEMPTS} attempts"


# η = 0: every step's tokens come from the adapter just published (engine_trainer_kl_k3 on
# each step); η = 2: the staleness bound asked for, KL on its steps with fresh tokens
@needs_vllm
# (2, inflight) is benchmark-marked for the suite's 15 minutes: in-flight publication on vLLM
# has its own test without LoRA (test_vllm_backend.py), and LoRA's keep mode is above
@pytest.mark.parametrize(
    ("eta", "mode"),
    [(0, "retract"), (2, "retract"), pytest.param(2, "inflight", marks=pytest.mark.benchmark)],
)
def test_lora_rl_on_vllm(lora_server, tmp_path, tiny_model_dir, eta, mode):
    """`relayrl train configs/async.yaml model.lora.r=8 rollout.engine=vllm` (the tiny model,
    the short run's sizes, 4 steps, a grader that rewards random outputs by parity so the
    adapters train, a learning rate that moves them visibly): trained, each publication
    adapter-only, verified and canaried (tolerance 1e-4: also "served, not the base"),
    engine-vs-trainer KL at vLLM's tolerance, the final adapter far from zero."""
    from relayrl.train.run import run_train
    from tests.train.conftest import parity_grader

    url, key = lora_server.urls[0], lora_server.key_of(0)
    overrides = [f"rollout.eta={eta}", "train.total_steps=4", "train.publish_canary_every=1"]
    overrides += [f"rollout.api_key={key}", "model.lora.r=8", "algo.loss=decoupled"]
    overrides += ["train.publish_every=1", "optim.lr=0.02", "rollout.n_samples=4"]
    overrides += ["train.publish_canary_tolerance=1e-4", "train.save_final=true"]
    overrides += [f"train.publish_mode={mode}"]
    config = short_run_config(tmp_path, tiny_model_dir, url, *overrides)
    assert config.model.lora == LoraConfig(r=8)
    result = run_train(config, grader=parity_grader)
    run = tmp_path / "ext"
    rows = [json.loads(ln) for ln in (run / "metrics.jsonl").read_text().splitlines()]
    steps = [r for r in rows if not r.get("final")]
    assert [r["step"] for r in steps] == [1, 2, 3, 4]
    assert all(r["staleness_max"] <= eta for r in steps)
    assert result.summary["publications"] >= 2
    assert result.summary["publish_canaries"] == result.summary["publications"]
    assert result.summary["publish_canary_max_logprob_diff"] < 1e-4
    kl = [r["engine_trainer_kl_k3"] for r in steps if "engine_trainer_kl_k3" in r]
    summary = result.summary
    print(
        f"engine_trainer_kl_k3 (vLLM, LoRA, η = {eta}, {mode}): {kl}; canary max |Δ| "
        f"{summary['publish_canary_max_logprob_diff']:.3g}; publications "
        f"{summary['publications']}, mean latency {summary['publish_latency_mean_s']:.3f} s"
    )
    assert len(kl) >= (4 if eta == 0 else 1) and all(k < MAX_MEAN_K3 for k in kl), kl
    # the adapters trained: the final merged model is far from the base (so the canaries
    # and KL above measured an adapter, not the base model)
    base = dict(load_model(tiny_model_dir).named_parameters())
    moved = max(
        (p - base[n]).abs().max().item()
        for n, p in load_model(run / "final_model").named_parameters()
    )
    print(f"largest weight change of the final merged model: {moved:.3g}")
    assert moved > 1e-3
