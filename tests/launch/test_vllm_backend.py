"""The vLLM rollout backend against a REAL vLLM server (the .venv-vllm environment that
`make vllm` builds and `make test` depends on), started once on loopback for this module and
test_vllm_broadcast.py (tests/launch/conftest.py).

* exact data: token ids in and out, behaviour logprobs equal to the trainer's
  ``log_softmax(logits / T)`` recompute on the same weights (the bound is stated below);
* publication: weights saved by the trainer's own ``save_weights`` are served exactly,
  tied LM head included (vLLM's in-place reload alone leaves its CPU GEMM handle on the old
  weights: this test fails without relayrl's worker extension);
* interruption: requests cut by publications while they decode are resubmitted, lose and
  duplicate no token, and every token's logprob is that of the weights its version names;
  the same for groups sent as one request each;
* a group is one request (``n``, seeds ``s0 + j``) with exactly the data of one request per
  sample; a group above the server's ``max_num_seqs`` falls back to one request per sample;
* bad input: a missing vLLM environment, a Python without vLLM, a port in use, a model
  directory vLLM cannot load: one ``error:`` line naming the cause, non-zero exit, no
  process left behind.
"""

from __future__ import annotations

import asyncio
import json
import os
import re
import shutil
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from relayrl.engine.types import SamplingParams
from relayrl.engine.vllm_client import VLLMClient
from relayrl.errors import RelayError
from relayrl.launch.backends import make_backend
from relayrl.models.loading import load_model
from relayrl.rollout.controller import request_seed
from tests.launch._vllm import (
    CHECKOUT,
    MAX_LOGPROB_DIFF,
    MAX_MEAN_K3,
    VLLM_PYTHON,
    count_spanning_and_check_versions,
    needs_vllm,
    perturbed,
    prompts,
    publish_dir,
    recompute,
    short_run_config,
    vllm_config,
)

pytestmark = needs_vllm
BUDGET = 100  # output tokens per request in the interruption test (prompts <= 16 tokens)
# batches an interruption test may send until a publication lands on a running request: on
# a loaded machine (two pytest workers) vLLM's API server once published its /metrics gauges
# only after the engine had finished all 64 requests, so nothing paced by them could land
ATTEMPTS = 3
PUBLICATIONS = 12  # at most, in the interruption test (one after another while it decodes)


@pytest.fixture
def server(vllm_server):
    """The package's vLLM server over the tiny model (tests/launch/conftest.py): (url,
    launcher)."""
    KEYS.update(vllm_server.url_keys())  # each server holds a key of its own
    return vllm_server.urls[0], vllm_server


@pytest.fixture(scope="module")
def policy(tiny_model_dir):
    return load_model(tiny_model_dir, "cpu", "float32").eval()


def run(coro):
    return asyncio.run(coro)


def key_of(url: str) -> str:
    """The run key of the package's server at ``url`` (its launcher made one)."""
    return KEYS[url]


KEYS: dict[str, str] = {}


class CountingClient(VLLMClient):
    """A :class:`VLLMClient` that counts the generate requests (HTTP exchanges) it sends."""

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.generate_requests = 0

    async def _request(self, method, url, path, json=None, generation=False):
        self.generate_requests += path == self.GENERATE_PATH
        return await super()._request(method, url, path, json, generation)


def group_params(prompt_index: int, n: int, budget: int, temperature: float = 1.0):
    """A group's sampling parameters as the rollout controller makes them (run seed 3)."""
    return [
        SamplingParams(
            max_new_tokens=budget,
            temperature=temperature,
            seed=request_seed(3, prompt_index, j),
            ignore_eos=True,
        )
        for j in range(n)
    ]


async def generate_all(url, batch, params):
    async with VLLMClient([url], api_key=key_of(url)) as client:
        return await asyncio.gather(*(client.generate(p, params[i]) for i, p in enumerate(batch)))


# ------------------------------------------------------------------ exact data
@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_tokens_and_behaviour_logprobs_match_the_trainer(server, policy, temperature):
    url, _ = server
    batch = prompts(8, seed=1)
    params = [
        SamplingParams(max_new_tokens=24, temperature=temperature, seed=i, ignore_eos=True)
        for i in range(len(batch))
    ]
    gens = run(generate_all(url, batch, params))
    diffs, k3 = [], []
    for prompt, gen in zip(batch, gens, strict=True):
        assert gen.prompt_tokens == len(prompt)  # our ids went in as they are
        assert len(gen.output_ids) == 24 and gen.finish_reason == "length"
        assert gen.output_versions == [0] * 24
        ref = recompute(policy, prompt, gen.output_ids, temperature)
        rho = ref - torch.tensor(gen.output_logprobs)
        diffs.append(rho.abs().max().item())
        k3.append((torch.expm1(rho) - rho).mean().item())
    print(f"T={temperature}: max|dlogp|={max(diffs):.2e} mean_k3={sum(k3) / len(k3):.2e}")
    assert max(diffs) < MAX_LOGPROB_DIFF
    assert sum(k3) / len(k3) < MAX_MEAN_K3


def test_seeded_requests_are_reproducible(server):
    url, _ = server
    batch = prompts(2, seed=2) * 2
    params = [SamplingParams(max_new_tokens=16, seed=7 + i % 2) for i in range(4)]
    a, b, c, d = run(generate_all(url, batch, params))
    assert a.output_ids == c.output_ids and b.output_ids == d.output_ids


def test_many_seeded_requests_at_once(server):
    """More prompt tokens at once than one scheduler step takes (2048): with chunked prefill,
    vLLM 0.32's CPU worker died rewinding a seeded request's generator ('CPU Generator does
    not use offset'); relayrl starts it with whole-prompt prefill."""
    url, _ = server
    batch = [[(7 * i + j) % 240 + 3 for j in range(24)] for i in range(96)]  # 2304 tokens
    params = [SamplingParams(max_new_tokens=4, seed=i, ignore_eos=True) for i in range(96)]
    gens = run(generate_all(url, batch, params))
    assert [len(g.output_ids) for g in gens] == [4] * 96


# ------------------------------------------------------------------ groups
def test_a_group_is_one_request_with_the_data_of_one_request_per_sample(server, policy):
    """Three groups of 8 (the controller's seeds, consecutive within a group): 3 HTTP
    requests instead of 24, and every sample's token ids, behaviour logprobs and versions
    those of its own seeded request."""
    url, _ = server
    batch = prompts(3, seed=6)
    groups = [group_params(i, 8, 24, temperature=0.7) for i in range(len(batch))]

    async def both():
        async with (
            CountingClient([url], api_key=key_of(url)) as grouped,
            CountingClient([url], api_key=key_of(url)) as single,
        ):
            many = await asyncio.gather(
                *(
                    grouped.generate_many([p] * 8, g, key=f"g{i}")
                    for i, (p, g) in enumerate(zip(batch, groups, strict=True))
                )
            )
            each = await asyncio.gather(
                *(single.generate(p, q) for p, g in zip(batch, groups, strict=True) for q in g)
            )
            return grouped.generate_requests, many, single.generate_requests, each

    n_grouped, many, n_single, each = run(both())
    assert (n_grouped, n_single) == (3, 24)
    flat = [gen for group in many for gen in group]
    prompts_of = [p for p in batch for _ in range(8)]
    diff = 0.0
    for prompt, a, b in zip(prompts_of, flat, each, strict=True):
        assert a.output_ids == b.output_ids and len(a.output_ids) == 24
        assert a.output_versions == b.output_versions == [0] * 24
        assert a.finish_reason == b.finish_reason == "length"
        got = torch.tensor(a.output_logprobs)
        diff = max(diff, (got - torch.tensor(b.output_logprobs)).abs().max().item())
        ref = recompute(policy, prompt, a.output_ids, 0.7)
        assert (got - ref).abs().max().item() < MAX_LOGPROB_DIFF
    print(f"grouped vs per-sample: max|dlogp|={diff:.2e}")
    assert diff < MAX_LOGPROB_DIFF
    assert len({tuple(g.output_ids) for g in flat}) == len(flat)  # samples differ


def test_a_group_above_max_num_seqs_goes_one_request_per_sample(server):
    """The server runs 16 sequences (vllm_config): a group of 20 is refused as one request
    and sent as 20; the next group of that size goes per sample at once."""
    url, _ = server
    prompt = prompts(1, seed=7)[0]

    async def go():
        async with CountingClient([url], api_key=key_of(url)) as client:
            first = await client.generate_many([prompt] * 20, group_params(0, 20, 4), key="a")
            after_first = client.generate_requests
            second = await client.generate_many([prompt] * 20, group_params(1, 20, 4), key="b")
            return first, second, after_first, client.generate_requests - after_first

    first, second, n_first, n_second = run(go())
    assert (n_first, n_second) == (21, 20)
    assert [len(g.output_ids) for g in first + second] == [4] * 40


# ------------------------------------------------------------------ publication
def test_the_control_plane_needs_the_run_key_and_reaches_relayrl_methods_only(server, tmp_path):
    """The attack rows: ``/collective_rpc`` calling ``relayrl_load_weights`` (or any worker
    method) and ``/pause`` without a key; with the key, a worker method not relayrl's."""
    import httpx

    url, launcher = server
    key = key_of(url)
    assert key not in " ".join(Path(f"/proc/{launcher.pids[0]}/cmdline").read_text().split("\0"))
    load = {"method": "relayrl_load_weights", "kwargs": {"weights_path": str(tmp_path)}}
    for method, path, body in [
        ("POST", "/collective_rpc", load),
        ("POST", "/collective_rpc", {"method": "reload_weights"}),
        ("POST", "/pause", None),
        ("POST", "/update_weight_version", {"new_version": "99"}),
        ("POST", "/reset_prefix_cache", None),
        ("GET", "/v1/models", None),
        ("POST", "/inference/v1/generate", {"token_ids": [5, 6]}),
        ("GET", "/weight_info", None),
    ]:
        for headers in ({}, {"Authorization": "Bearer " + key[::-1]}):
            answer = httpx.request(method, url + path, json=body, headers=headers, timeout=30)
            assert answer.status_code == 401, (path, answer.text)
    auth = {"Authorization": f"Bearer {key}"}
    for method in ("reload_weights", "execute_model", "save_sharded_state", "relayrl_nope"):
        answer = httpx.post(url + "/collective_rpc", json={"method": method}, headers=auth)
        assert answer.status_code == 403, (method, answer.text)
    assert httpx.get(url + "/health", timeout=30).status_code == 200
    info = httpx.get(url + "/weight_info", headers=auth, timeout=30)
    assert info.status_code == 200, info.text


def test_published_weights_are_served_exactly_with_their_version(server, policy, tmp_path):
    url, _ = server
    new = perturbed(policy, seed=11)
    path = publish_dir(new, tmp_path / "v5")
    batch = prompts(4, seed=3)
    params = [SamplingParams(max_new_tokens=20, seed=i, ignore_eos=True) for i in range(4)]

    async def publish_then_generate():
        async with VLLMClient([url], api_key=key_of(url)) as client:
            start = time.perf_counter()
            await client.update_weights(str(path), version=5)
            seconds = time.perf_counter() - start
            gens = await asyncio.gather(
                *(client.generate(p, q) for p, q in zip(batch, params, strict=True))
            )
            # back to version 0 for the other tests
            await client.update_weights(str(publish_dir(policy, tmp_path / "v0")), version=0)
            return seconds, gens

    seconds, gens = run(publish_then_generate())
    print(f"publication (pause, load, set version, resume): {seconds:.3f}s")
    for prompt, gen in zip(batch, gens, strict=True):
        assert gen.output_versions == [5] * 20
        new_ref = recompute(new, prompt, gen.output_ids, 1.0)
        old_ref = recompute(policy, prompt, gen.output_ids, 1.0)
        got = torch.tensor(gen.output_logprobs)
        assert (got - new_ref).abs().max().item() < MAX_LOGPROB_DIFF
        assert (got - old_ref).abs().max().item() > 10 * MAX_LOGPROB_DIFF  # it did change


# ------------------------------------------------------------------ interruption
@pytest.mark.parametrize("grouped", [False, True], ids=["per-sample", "grouped"])
@pytest.mark.parametrize("mode", ["abort", "keep"])
def test_interrupted_requests_keep_exact_versions(server, policy, tmp_path, mode, grouped):
    """Publications one after another, versions 1, 2, ... (at most :data:`PUBLICATIONS`),
    for as long as 64 requests decode, 16 at a time (the server's rollout.max_running_requests).
    Paced by the requests, not by the clock: each publication waits until the server is
    decoding (:class:`DecodePacer`); publications at fixed moments missed the waves both on
    a lightly loaded machine (the first wave was done) and on a slow one (all landed before
    decoding began; CI, 2026-11-25, twice); vLLM's ``/metrics`` token counter moves in jumps
    of thousands of tokens, too coarse to pace by, its running-requests gauge is not.
    Every request ends with exactly its budget (no token lost or duplicated), its versions
    never go down, some requests span versions, and (abort-and-resubmit) each token's
    logprob is that of the weights its version names. ``keep``: the running requests keep
    their KV across the update (PipelineRL's in-flight update), so only the version tags are
    checked.
    ``grouped``: the 64 go out as 8 groups of 8, one request each (``generate_many``), whose
    aborted samples are resubmitted one by one."""
    url, _ = server
    models = {0: policy} | {v: perturbed(policy, seed=100 + v) for v in range(1, PUBLICATIONS + 1)}
    dirs = {v: publish_dir(m, tmp_path / f"v{v}") for v, m in models.items()}
    batch = [p for p in prompts(8, seed=4) for _ in range(8)] if grouped else prompts(64, seed=4)
    params = [SamplingParams(max_new_tokens=BUDGET, seed=i, ignore_eos=True) for i in range(64)]

    async def go():
        async with VLLMClient([url], api_key=key_of(url)) as client:
            # the server's first pause can take ~2 s, long enough for all the waves to end
            await client.update_weights(str(dirs[0]), 0, keep_kv=mode == "keep")
            pacer = DecodePacer(url)
            tasks = submit(client, batch, params, grouped)
            for version in range(1, PUBLICATIONS + 1):
                if not await pacer.until_decoding(tasks):
                    break
                await client.update_weights(str(dirs[version]), version, keep_kv=mode == "keep")
            gens = [g for out in await asyncio.gather(*tasks) for g in out]
            await client.update_weights(str(dirs[0]), version=0)
            return gens

    for _ in range(ATTEMPTS):  # every attempt's versions and logprobs are checked
        gens = run(go())
        spanning = count_spanning_and_check_versions(batch, gens, models, mode, BUDGET)
        print(f"{mode}: {spanning}/{len(batch)} requests span versions")
        if spanning:
            break
    assert spanning > 0, f"no request was interrupted in {ATTEMPTS} attempts"
    if mode == "abort":
        assert sum(g.resubmissions for g in gens) >= spanning


RUNNING = re.compile(r"^vllm:num_requests_running(?:\{[^}]*\})? ([0-9.e+]+)$", re.M)
FIRST_TOKENS = re.compile(
    r"^vllm:time_to_first_token_seconds_count(?:\{[^}]*\})? ([0-9.e+]+)$", re.M
)


class DecodePacer:
    """Paces publications by the server's progress, read from vLLM's open ``/metrics``: the
    next publication waits until a request is running *and* some request got its first
    token since the previous one, so that it lands on a request with tokens of the version
    before. Under load (CI, 2026-11-25: 0 of 64 requests spanned a version) vLLM took longer
    to start decoding than 12 publications paced only by a 20 ms sleep. With two pytest
    workers on two cores, vLLM's API server once updated its gauges only after the engine had
    finished the whole batch: nothing paced by them could land, so the test tries again
    (``ATTEMPTS``)."""

    def __init__(self, url: str, deadline_s: float = 120.0) -> None:
        self.url, self.deadline_s = url, deadline_s
        self.first_tokens = self.read()[1]

    def read(self) -> tuple[float, float]:
        """(requests running, first tokens so far) summed over the server's engines."""
        import urllib.request

        with urllib.request.urlopen(self.url + "/metrics", timeout=10) as answer:
            text = answer.read().decode()
        running, first = RUNNING.findall(text), FIRST_TOKENS.findall(text)
        assert running and first, "vLLM's /metrics lacks the running or first-token metric"
        return sum(map(float, running)), sum(map(float, first))

    async def until_decoding(self, tasks) -> bool:
        """True once the next publication may go out; False once every task is done."""
        end = time.monotonic() + self.deadline_s
        while not all(task.done() for task in tasks):
            running, first = await asyncio.to_thread(self.read)
            if running > 0 and first > self.first_tokens:
                self.first_tokens = first
                return True
            assert time.monotonic() < end, f"no request decoding within {self.deadline_s} s"
            await asyncio.sleep(0.02)
        return False


def submit(client, batch, params, grouped):
    """Tasks generating ``batch``: one request per prompt, or (``grouped``) groups of 8
    consecutive prompts (equal ones) and seeds as one request each; each task's result is a
    list of generations, in ``batch`` order."""

    async def one(prompt, param):
        return [await client.generate(prompt, param)]

    if not grouped:
        return [asyncio.create_task(one(p, q)) for p, q in zip(batch, params, strict=True)]
    return [
        asyncio.create_task(client.generate_many(batch[i : i + 8], params[i : i + 8]))
        for i in range(0, len(batch), 8)
    ]


# ------------------------------------------------------------------ bad input
def relayrl_train(tmp_path: Path, model_dir: Path, *overrides: str) -> subprocess.CompletedProcess:
    env = dict(os.environ, PYTHONPATH=str(CHECKOUT))
    args = [f"output_dir={tmp_path}", "name=bad", f"model.path={model_dir}"]
    args += ["model.max_context=128", "rollout.engine=vllm", "train.progress=false"]
    return subprocess.run(
        [sys.executable, "-m", "relayrl.cli", "train", "configs/async.yaml", *args, *overrides],
        cwd=CHECKOUT,
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )


def processes_mentioning(marker: str) -> list[int]:
    found = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit() and entry.name != str(os.getpid()):
            try:
                if marker.encode() in (entry / "cmdline").read_bytes():
                    found.append(int(entry.name))
            except OSError:
                continue
    return found


def process_group(pgid: int) -> list[int]:
    """Live processes of process group ``pgid`` (a vLLM server's engine core and worker
    rename themselves, so their command lines do not name the model)."""
    members = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                fields = (entry / "stat").read_text().rsplit(")", 1)[1].split()
            except OSError:
                continue
            if int(fields[2]) == pgid and fields[0] != "Z":
                members.append(int(entry.name))
    return members


def one_error_line(result: subprocess.CompletedProcess) -> str:
    assert result.returncode != 0, result.stdout + result.stderr
    errors = [ln for ln in result.stderr.splitlines() if ln.startswith("error: ")]
    assert len(errors) == 1, result.stderr
    assert "Traceback" not in result.stderr, result.stderr
    return errors[0]


def test_missing_or_broken_vllm_environment_is_one_error_line(tmp_path, tiny_model_dir):
    missing = one_error_line(
        relayrl_train(tmp_path, tiny_model_dir, "rollout.vllm.python=/nonexistent/python")
    )
    assert "rollout.vllm.python: /nonexistent/python is not an executable file" in missing
    assert "make vllm" in missing
    no_vllm = one_error_line(
        relayrl_train(tmp_path, tiny_model_dir, f"rollout.vllm.python={sys.executable}")
    )
    assert f"{sys.executable} has no vLLM installed" in no_vllm


def test_port_in_use_is_one_error_line(tmp_path, tiny_model_dir):
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        line = one_error_line(
            relayrl_train(
                tmp_path,
                tiny_model_dir,
                f"rollout.vllm.port={port}",
                f"rollout.vllm.python={VLLM_PYTHON}",
            )
        )
    assert f"port {port} on 127.0.0.1 is in use" in line


def test_a_model_vllm_cannot_load_is_one_error_line_and_leaves_no_process(tmp_path, tiny_model_dir):
    broken = tmp_path / "broken-model"
    shutil.copytree(tiny_model_dir, broken)
    config = json.loads((broken / "config.json").read_text())
    config["architectures"] = ["NoSuchModelForCausalLM"]
    (broken / "config.json").write_text(json.dumps(config))
    result = relayrl_train(tmp_path, broken, f"rollout.vllm.python={VLLM_PYTHON}")
    line = one_error_line(result)
    assert "rollout server 0" in line and "exited with code" in line, line
    assert "NoSuchModelForCausalLM" in line, line  # the log line that says why
    assert (tmp_path / "bad" / "server-0.log").is_file()
    assert processes_mentioning(str(broken)) == []
    pid = int(re.search(r"pid (\d+)\)", line).group(1))  # the server led its own group
    assert process_group(pid) == []


def test_thread_mode_is_refused_for_vllm(tiny_model_dir):
    config = vllm_config(tiny_model_dir, "rollout.server_mode=thread")
    with pytest.raises(RelayError, match="server_mode=thread runs only rollout.engine=builtin"):
        make_backend(config, tiny_model_dir).launcher(None)


# ------------------------------------------------------------------ external servers
def test_a_server_of_another_kind_is_refused(tmp_path, tiny_model_dir):
    from relayrl.engine.engine import Engine
    from relayrl.engine.server import ServerThread, create_app
    from relayrl.train.run import run_train

    with Engine.from_pretrained(str(tiny_model_dir)) as engine:
        builtin = ServerThread(create_app(engine)).start()
        try:
            with pytest.raises(RelayError, match="does not expose vLLM's RL endpoints"):
                run_train(short_run_config(tmp_path, tiny_model_dir, builtin.url))
        finally:
            builtin.stop()


# retract/disk runs in the suite; the other two (about 70 s more) with `pytest -m benchmark`
# (the broadcast path at eta = 4 is covered by tests/train/test_broadcast_train.py otherwise)
@pytest.mark.parametrize(
    ("mode", "transport"),
    [
        ("retract", "disk"),
        pytest.param("abort", "disk", marks=pytest.mark.benchmark),
        pytest.param("retract", "broadcast", marks=pytest.mark.benchmark),
    ],
)
def test_a_run_at_eta_4_publishes_exact_weights(server, tmp_path, tiny_model_dir, mode, transport):
    """The demo's η = 4 on vLLM (issue 35: it hung with the server paused): 6 steps, a
    publication every step landing while up to (η + 1)·B·n requests are in flight, each
    verified (version and checksum) and the first one's canary; on every step the engine's
    behaviour logprobs of the tokens of the trainer's version equal the trainer's recompute
    (engine_trainer_kl_k3), and no sample is staler than η."""
    from relayrl.train.run import run_train

    url, _ = server
    run(load_model_dir(url, tiny_model_dir))  # the run's v0 (a test before left its own)
    overrides = ["rollout.eta=4", "train.total_steps=6", f"train.publish_mode={mode}"]
    overrides += [f"train.weight_transport={transport}", "train.broadcast_timeout_s=60"]
    overrides += ["rollout.prompts_per_step=4", "rollout.n_samples=4"]
    overrides += [f"rollout.api_key={key_of(url)}"]
    result = run_train(short_run_config(tmp_path, tiny_model_dir, url, *overrides))
    rows = [json.loads(ln) for ln in (tmp_path / "ext" / "metrics.jsonl").read_text().splitlines()]
    steps = [r for r in rows if not r.get("final")]
    assert [r["step"] for r in steps] == list(range(1, 7))
    assert result.summary["publications"] >= 4  # the last may still be loading at the end
    assert result.summary["publish_canaries"] >= 1
    assert result.summary["publish_canary_max_logprob_diff"] < MAX_LOGPROB_DIFF
    kl = [r["engine_trainer_kl_k3"] for r in steps if "engine_trainer_kl_k3" in r]
    assert kl and all(k < MAX_MEAN_K3 for k in kl), kl
    samples = [json.loads(ln) for ln in (tmp_path / "ext" / "samples.jsonl").open()]
    assert all(s["trainer_version"] - s["version_min"] <= 4 for s in samples)


async def load_model_dir(url: str, model_dir) -> None:
    async with VLLMClient([url], api_key=key_of(url)) as client:
        await client.update_weights(str(model_dir), version=0)


def test_a_run_on_an_external_vllm_server(server, tmp_path, tiny_model_dir):
    """Last in the module: it leaves its own weights on the shared server."""
    from relayrl.train.run import run_train

    url, launcher = server
    key = launcher.key_of(0)  # an external server's key: rollout.api_key (or the env)
    result = run_train(short_run_config(tmp_path, tiny_model_dir, url, f"rollout.api_key={key}"))
    rows = [json.loads(ln) for ln in (tmp_path / "ext" / "metrics.jsonl").read_text().splitlines()]
    assert result.steps == 2 and [r["step"] for r in rows[:2]] == [1, 2]
    assert result.summary["publications"] == 1
    assert launcher.exit_code(0) is None  # an external server is not stopped by the run
    assert not (tmp_path / "ext" / "server-0.log").exists()  # nor launched
