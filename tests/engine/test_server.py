"""Rollout server + async client over a real loopback uvicorn server: bad input, API keys,
a weight update inside a request (abort-then-resubmit and retract), a burst of requests with
disconnecting clients."""

from __future__ import annotations

import asyncio
import copy
import time
from types import SimpleNamespace

import httpx
import pytest

from relayrl.engine.client import RolloutClient, RolloutServerError, continuation_seed
from relayrl.engine.server import GenerateIn, ServerThread, _response, check_bind, create_app
from relayrl.engine.types import GenerationResult, SamplingParams
from relayrl.errors import RelayError
from tests.engine.conftest import kept_kv_logprobs, perturbed_state, recompute_logprobs


@pytest.fixture
def served(make_engine):
    """(engine, base url) of a server on 127.0.0.1 with a free port, stopped afterwards."""
    started: list[ServerThread] = []

    def start(api_key: str | None = None, **options):
        engine = make_engine(**options)
        server = ServerThread(create_app(engine, api_key)).start()
        started.append(server)
        return engine, server.url

    yield start
    for server in started:
        server.stop()


def wait_until(predicate, timeout: float = 30.0) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        assert time.monotonic() < deadline, "condition not reached in time"
        time.sleep(0.02)


def test_generate_schema_and_info(served):
    engine, url = served()
    body = {
        "input_ids": [5, 6, 7],
        "sampling_params": {"max_new_tokens": 6, "temperature": 0, "ignore_eos": True},
        "return_logprob": True,
    }
    data = httpx.post(f"{url}/generate", json=body, timeout=30).json()
    meta = data["meta_info"]
    assert len(data["output_ids"]) == 6 and meta["finish_reason"] == {"type": "length", "length": 6}
    assert [t[1] for t in meta["output_token_logprobs"]] == data["output_ids"]
    assert meta["output_token_versions"] == [0] * 6 and meta["prompt_tokens"] == 3
    # the text skips special tokens (SGLang's default), as the trainer's decode does
    expected = engine.tokenizer.decode(data["output_ids"], skip_special_tokens=True)
    assert data["text"] == expected

    async def with_client():
        async with RolloutClient(url) as client:
            return await client.generate([5, 6, 7], body["sampling_params"])

    out = asyncio.run(with_client())
    assert out.output_ids == data["output_ids"] and out.text == expected
    eos = engine.tokenizer.eos_token_id
    ended = GenerationResult("r", [5], [9, 10, eos], [-1.0] * 3, [0] * 3, "stop", 1)
    text = _response(engine, ended, GenerateIn(input_ids=[5]))["text"]
    assert text == engine.tokenizer.decode([9, 10]) != engine.tokenizer.decode([9, 10, eos])
    info = httpx.get(f"{url}/get_model_info").json()
    assert info["vocab_size"] == engine.vocab_size and info["weight_version"] == 0
    assert info["max_context_length"] == engine.max_seq_len


BAD_REQUESTS = [
    ("/generate", b"{not json", "malformed JSON"),
    ("/generate", {"input_ids": []}, "input_ids"),
    ("/generate", {"input_ids": [10**7]}, "vocabulary"),
    ("/generate", {"input_ids": [1], "sampling_params": {"max_new_tokens": 0}}, "max_new_tokens"),
    (
        "/generate",
        {"input_ids": [1] * 8, "sampling_params": {"max_new_tokens": 10**5}},
        "max_seq_len",
    ),
    ("/generate", {"input_ids": [1], "bogus": 1}, "bogus"),
    ("/generate", {"input_ids": [1], "sampling_params": {"temprature": 1}}, "temprature"),
    ("/generate", {"input_ids": "abc"}, "input_ids"),
    ("/update_weights_from_disk", {"model_path": "/nonexistent/weights"}, "model_path"),
    ("/pause_generation", {"mode": "sideways"}, "mode"),
]


def test_bad_input_gets_4xx_and_server_keeps_serving(served):
    _, url = served()
    with httpx.Client(base_url=url, timeout=30) as http:
        for path, body, field in BAD_REQUESTS:
            if isinstance(body, bytes):
                r = http.post(path, content=body, headers={"content-type": "application/json"})
            else:
                r = http.post(path, json=body)
            assert 400 <= r.status_code < 500, (path, body, r.status_code, r.text)
            assert field in r.json()["error"], (field, r.json())
        assert http.get("/health").json() == {"status": "ok"}
        ok = http.post(
            "/generate", json={"input_ids": [3, 4], "sampling_params": {"max_new_tokens": 2}}
        )
        assert ok.status_code == 200


# every endpoint but /health (app.routes of create_app), with a body that would be accepted
MUTATING = [
    ("POST", "/update_weights_from_disk", {"model_path": "/tmp", "weight_version": 7}),
    ("POST", "/pause_generation", {"mode": "abort"}),
    ("POST", "/continue_generation", None),
    (
        "POST",
        "/init_weights_update_group",
        {
            "master_address": "127.0.0.1",
            "master_port": 1,
            "rank_offset": 1,
            "world_size": 2,
            "group_name": "g",
        },
    ),
    (
        "POST",
        "/update_weights_from_distributed",
        {"names": ["x"], "dtypes": ["float32"], "shapes": [[1]], "group_name": "g"},
    ),
]
READING = [
    ("POST", "/generate", {"input_ids": [5, 6], "sampling_params": {"max_new_tokens": 2}}),
    ("POST", "/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}]}),
    ("POST", "/v1/completions", {"prompt": "hi", "max_tokens": 2}),
    ("POST", "/inference/v1/generate", {"token_ids": [5, 6], "sampling_params": {"max_tokens": 2}}),
    ("GET", "/v1/models", None),
    ("GET", "/get_model_info", None),
    ("GET", "/get_server_info", None),
    ("GET", "/weights_checksum", None),
]


def test_every_route_but_health_is_in_the_key_table():
    """A new route must be added to MUTATING or READING (and so to the key test)."""
    app = create_app(SimpleNamespace(), None)
    paths = {r.path for r in app.routes if not r.path.startswith(("/docs", "/openapi", "/redoc"))}
    assert paths == {"/health"} | {p for _, p, _ in MUTATING + READING}


def test_api_key_is_enforced(served):
    engine, url = served(api_key="s3cret")
    assert httpx.get(f"{url}/health").status_code == 200  # the one open endpoint
    for method, path, body in MUTATING + READING:
        for headers in ({}, {"Authorization": "Bearer nope"}, {"Authorization": "s3cret"}):
            answer = httpx.request(method, f"{url}{path}", json=body, headers=headers)
            assert answer.status_code == 401, (path, headers)
    assert engine.weight_version == 0
    ok = httpx.get(f"{url}/get_model_info", headers={"Authorization": "Bearer s3cret"})
    assert ok.status_code == 200

    async def via_client():
        async with RolloutClient(url, api_key="s3cret") as client:
            out = await client.generate([5, 6], {"max_new_tokens": 3, "ignore_eos": True})
            assert len(out.output_ids) == 3
        async with RolloutClient(url) as client:
            with pytest.raises(RolloutServerError, match="401"):
                await client.generate([5, 6], {"max_new_tokens": 3})

    asyncio.run(via_client())
    with pytest.raises(RelayError, match="API key"):
        check_bind("0.0.0.0", None)
    check_bind("0.0.0.0", "k")
    check_bind("127.0.0.1", None)
    check_bind("::1", None)


def test_client_names_the_down_server_and_routes_sticky(served):
    _, url = served()

    async def scenario():
        dead = "http://127.0.0.1:9"  # discard port: nothing listens
        async with RolloutClient([url, dead], max_retries=1, backoff=0.01) as client:
            assert client.server_for("group-a") == client.server_for("group-a")
            assert {client.server_for(None), client.server_for(None)} == {url, dead}
            with pytest.raises(RolloutServerError, match="127.0.0.1:9.*unreachable"):
                await client.generate_once([5], {"max_new_tokens": 2}, url=dead)
            with pytest.raises(RolloutServerError, match="HTTP 400"):
                await client.generate_once([], {"max_new_tokens": 2}, url=url)

    asyncio.run(scenario())


@pytest.mark.parametrize(
    ("mode", "batched"), [("abort", False), ("abort", True), ("retract", False), ("inflight", True)]
)
def test_interrupted_request_keeps_a_consistent_trajectory(
    served, tiny_model, tmp_path, mode, batched
):
    """A weight update in the middle of a request, as the three publication modes do it:
    ``abort`` (pause, load, continue; the client resubmits the partial output), ``retract``
    (load only; the server re-queues the request and prefills it again) and ``inflight``
    (load only; the request keeps its KV). Every way the old tokens keep version 0 and the
    old policy's logprobs, the rest are version 5 with the new policy's (for ``inflight``:
    the new weights over the old KV). ``batched``: sent as a one-prompt batch
    (``generate_many``), whose aborted answers are resubmitted one by one."""
    old_model = copy.deepcopy(tiny_model)
    new_model = copy.deepcopy(tiny_model)
    new_model.load_state_dict(perturbed_state(tiny_model), strict=False)
    new_model.save_pretrained(tmp_path / "v5")
    engine, url = served()
    prompt, budget = [7, 8, 9, 10], 200
    params = SamplingParams(max_new_tokens=budget, temperature=1.0, seed=11, ignore_eos=True)

    async def scenario():
        async with RolloutClient(url) as client:
            if batched:
                many = client.generate_many([prompt], [params], key="g0")
                task = asyncio.create_task(many)
            else:
                task = asyncio.create_task(client.generate(prompt, params, key="g0"))
            while engine.stats()["generated_tokens"] < 10:
                await asyncio.sleep(0.01)
            if mode != "abort":
                keep_kv = mode == "inflight"
                await client.update_weights(str(tmp_path / "v5"), version=5, keep_kv=keep_kv)
                return await task
            await client.pause("abort")
            await client.update_weights(str(tmp_path / "v5"), version=5)
            await asyncio.sleep(0.1)
            assert not task.done()  # waiting for continue
            await client.continue_generation()
            return await task

    out = asyncio.run(scenario())
    out = out[0] if batched else out
    n = len(out.output_ids)
    assert n == len(out.output_logprobs) == len(out.output_versions) == budget
    assert out.finish_reason == "length"
    assert out.resubmissions >= 1 if mode == "abort" else out.resubmissions == 0
    n_old = out.output_versions.count(0)
    assert 10 <= n_old < budget and out.output_versions == [0] * n_old + [5] * (budget - n_old)
    old_ref = recompute_logprobs(old_model, prompt, out.output_ids, 1.0)
    if mode == "inflight":
        new_ref = kept_kv_logprobs(old_model, new_model, prompt, out.output_ids, n_old, 1.0)
    else:
        new_ref = recompute_logprobs(new_model, prompt, out.output_ids, 1.0)[n_old:]
    assert (
        max(abs(a - b) for a, b in zip(old_ref[:n_old], out.output_logprobs[:n_old], strict=True))
        < 1e-4
    )
    assert max(abs(a - b) for a, b in zip(new_ref, out.output_logprobs[n_old:], strict=True)) < 1e-4
    assert engine.stats()["kept_kv"] == (1 if mode == "inflight" else 0)
    if mode == "abort":
        assert continuation_seed(11, n_old) not in (None, 11)
    assert engine.stats()["num_requests"] == 0


def test_batched_generate_answers_each_prompt_as_alone(served):
    """SGLang's list form: one answer per prompt, in order, each what the same request
    alone gives (seeded); a field of the wrong length or a bad prompt is a 400 naming it,
    and the client's generate_many goes through it."""
    engine, url = served()
    prompts = [[5, 6, 7], [9, 8], [5, 6, 7]]
    params = [
        {"max_new_tokens": 5, "temperature": 1.0, "seed": s, "ignore_eos": True} for s in (1, 2, 3)
    ]
    alone = [
        httpx.post(
            f"{url}/generate", json={"input_ids": p, "sampling_params": sp}, timeout=30
        ).json()
        for p, sp in zip(prompts, params, strict=True)
    ]
    body = {"input_ids": prompts, "sampling_params": params, "return_logprob": True}
    batch = httpx.post(f"{url}/generate", json=body, timeout=30).json()
    assert [a["output_ids"] for a in batch] == [a["output_ids"] for a in alone]
    assert all(len(a["meta_info"]["output_token_logprobs"]) == 5 for a in batch)
    assert alone[0]["output_ids"] != alone[2]["output_ids"]  # the seeds matter

    shared = httpx.post(
        f"{url}/generate", json={"input_ids": prompts[:2], "sampling_params": params[0]}
    ).json()
    assert [len(a["output_ids"]) for a in shared] == [5, 5]
    short = httpx.post(f"{url}/generate", json={**body, "sampling_params": params[:2]})
    assert short.status_code == 400 and "sampling_params: 2 entries for 3" in short.text
    bad = httpx.post(f"{url}/generate", json={**body, "input_ids": [[5], [10**7], [6]]})
    assert bad.status_code == 400 and "input_ids[1]" in bad.text

    async def with_client():
        async with RolloutClient(url) as client:
            return await client.generate_many(prompts, params, key="g")

    outs = asyncio.run(with_client())
    assert [o.output_ids for o in outs] == [a["output_ids"] for a in alone]
    assert all(o.text == a["text"] for o, a in zip(outs, alone, strict=True))
    assert engine.stats()["num_requests"] == 0


def test_burst_and_disconnects_leave_no_leaked_requests(served):
    engine, url = served(max_running_requests=64)
    long_body = {
        "input_ids": [5, 6],
        "sampling_params": {"max_new_tokens": 400, "ignore_eos": True},
    }

    async def scenario():
        # Eight long requests are admitted first, then dropped by their clients half-way
        # through a burst of 500 short ones (dropping on a timer instead flakes under load).
        async with httpx.AsyncClient(timeout=60) as http:
            doomed = [
                asyncio.create_task(http.post(f"{url}/generate", json=long_body)) for _ in range(8)
            ]
            while engine.stats()["num_requests"] < 8:
                await asyncio.sleep(0.01)
            async with RolloutClient(url, max_connections=100) as client:
                burst = [
                    asyncio.create_task(
                        client.generate(
                            [3 + i % 50, 4], {"max_new_tokens": 3, "temperature": 0.8, "seed": i}
                        )
                    )
                    for i in range(500)
                ]
                for done, next_result in enumerate(asyncio.as_completed(burst), start=1):
                    await next_result
                    if done == 250:
                        for task in doomed:
                            task.cancel()
                outs = [task.result() for task in burst]
            assert all(task.cancelled() for task in doomed)
        assert all(1 <= len(o.output_ids) <= 3 and o.finish_reason != "abort" for o in outs)

    asyncio.run(scenario())
    wait_until(lambda: engine.stats()["num_requests"] == 0, timeout=20)
    stats = engine.stats()
    assert stats["num_running"] == stats["num_waiting"] == 0
    assert stats["aborted"] == 8  # the disconnected requests were cut short, not run to the end
    assert httpx.get(f"{url}/health").status_code == 200


def test_serve_cli_refuses_public_host_without_key(tiny_model_dir, monkeypatch, capsys):
    from relayrl.cli import main

    monkeypatch.delenv("RELAYRL_API_KEY", raising=False)
    assert main(["serve", "--model", str(tiny_model_dir), "--host", "0.0.0.0"]) == 2
    assert "API key" in capsys.readouterr().err


def test_bench_workload_is_long_tailed():
    from relayrl.bench.engine import make_workload

    work = make_workload(256, 8, 512, 300, seed=0)
    assert len(work.prompts) == len(work.lengths) == 256
    assert min(work.lengths) >= 8 and max(work.lengths) == 512
    lengths = sorted(work.lengths)
    assert lengths[128] < 32 < 256 < lengths[-3]  # short median, a few very long ones
