"""``relayrl eval --server-url``: evaluation through a rollout backend's client on a built-in
server started here on loopback (the same FastAPI app ``relayrl serve`` runs, in a thread),
against the in-process engine of ``relayrl eval`` without it."""

from __future__ import annotations

import json
import socket
from collections.abc import Iterator

import pytest

from relayrl.cli import main
from relayrl.engine.engine import Engine
from relayrl.engine.server import ServerThread, create_app
from relayrl.engine.types import EngineOptions
from tests.eval.test_eval_command import run_eval


@pytest.fixture
def serve(tiny_model_dir) -> Iterator:
    """``serve(**engine_options) -> url`` of a built-in server over the tiny model."""
    running: list[tuple[Engine, ServerThread]] = []

    def start(**options) -> str:
        engine = Engine.from_pretrained(str(tiny_model_dir), EngineOptions(**options))
        server = ServerThread(create_app(engine)).start()
        running.append((engine, server))
        return server.url

    yield start
    for engine, server in running:
        server.stop()
        engine.shutdown()


def closed_port_url() -> str:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return f"http://127.0.0.1:{s.getsockname()[1]}"


def eval_rows(model_dir, tmp_path, capsys, name: str, *extra: str) -> tuple[list[dict], list[str]]:
    out = tmp_path / f"{name}.jsonl"
    options = ("--limit", "5", "--max-new-tokens", "20", "--seed", "7", "--workers", "1")
    assert run_eval(model_dir, "arithmetic", out, *options, *extra) == 0
    lines = capsys.readouterr().out.strip().splitlines()
    return [json.loads(x) for x in out.read_text().splitlines()], lines[1:]


@pytest.mark.parametrize("sampling", [("--temperature", "0"), ("--temperature", "1", "--n", "3")])
def test_server_eval_equals_in_process_eval(sampling, serve, tiny_model_dir, tmp_path, capsys):
    """Same seed, same problems: the same completions, rewards and report lines. Greedy is
    exact by construction; at T = 1 each request's sampler is seeded by ``request_seed``
    on the server as in process, and the engine's per-request logits do not depend on what
    else is batched with it (tests/engine), so sampled completions agree too."""
    local, local_lines = eval_rows(tiny_model_dir, tmp_path, capsys, "local", *sampling)
    url = serve()
    remote, remote_lines = eval_rows(
        tiny_model_dir, tmp_path, capsys, "remote", *sampling, "--server-url", url
    )
    assert remote == local
    assert remote_lines[1:] == local_lines[1:]  # pass@k, maj@k, pass@1
    assert "weight_version=0" in remote_lines[0]
    if "--n" in sampling:  # not vacuous: sampled completions of the untrained model vary
        assert len({c for row in local for c in row["completions"]}) > 5


def test_report_names_the_servers_weight_version(serve, tiny_model_dir, tmp_path, capsys):
    url = serve(weight_version=5)
    _, lines = eval_rows(tiny_model_dir, tmp_path, capsys, "v5", "--server-url", url)
    assert "weight_version=5" in lines[0]


def test_servers_on_different_versions_are_refused(serve, tiny_model_dir, capsys):
    urls = [serve(weight_version=1), serve(weight_version=2)]
    capsys.readouterr()
    code = main(
        ["eval", "--model", str(tiny_model_dir), "--data", "arithmetic"]
        + [x for url in urls for x in ("--server-url", url)]
    )
    err = capsys.readouterr().err.strip().splitlines()
    assert code != 0 and len(err) == 1
    assert err[0] == (
        f"error: rollout servers on different weight versions {{{urls[0]!r}: 1, {urls[1]!r}: 2}}"
        ": an evaluation needs one version"
    )


def bad_server_error(model_dir, capsys, *server_args: str) -> str:
    capsys.readouterr()
    code = main(["eval", "--model", str(model_dir), "--data", "arithmetic", *server_args])
    err = capsys.readouterr().err.strip().splitlines()
    assert code != 0
    assert len(err) == 1, err
    return err[0]


def test_unreachable_server_url_is_one_error_line(tiny_model_dir, capsys):
    url = closed_port_url()
    line = bad_server_error(tiny_model_dir, capsys, "--server-url", url)
    assert line == (
        f"error: --server-url[0]: {url} did not answer GET /health; is it running and reachable?"
    )


def test_server_url_without_scheme_is_one_error_line(tiny_model_dir, capsys):
    line = bad_server_error(tiny_model_dir, capsys, "--server-url", "127.0.0.1:30000")
    assert line == "error: --server-url '127.0.0.1:30000': expected an http:// or https:// URL"


def test_wrong_protocol_is_named(serve, tiny_model_dir, capsys):
    """A built-in server evaluated as a vLLM one: the backend's protocol check names it."""
    url = serve()
    line = bad_server_error(tiny_model_dir, capsys, "--server-url", url, "--engine", "vllm")
    assert line.startswith(f"error: rollout server {url} does not expose vLLM's RL endpoints")


def test_unknown_engine_is_one_error_line(tiny_model_dir, capsys):
    line = bad_server_error(
        tiny_model_dir, capsys, "--server-url", "http://127.0.0.1:1", "--engine", "sglang"
    )
    assert line.startswith("error: --engine: unknown rollout backend 'sglang'")


def test_config_server_urls_and_model_path_are_used(serve, tiny_model_dir, tmp_path, capsys):
    """``--config``: its model.path is the model, its rollout.server_urls the servers."""
    sampling = ("--temperature", "1", "--n", "2")
    local, local_lines = eval_rows(tiny_model_dir, tmp_path, capsys, "local", *sampling)
    url = serve(weight_version=4)
    config = tmp_path / "run.yaml"
    config.write_text(f"model:\n  path: {tiny_model_dir}\nrollout:\n  server_urls: [{url}]\n")
    out = tmp_path / "config.jsonl"
    options = ("--limit", "5", "--max-new-tokens", "20", "--seed", "7", "--workers", "1")
    argv = ["eval", "--config", str(config), "--data", "arithmetic", "--out", str(out)]
    assert main([*argv, *options, *sampling]) == 0
    lines = capsys.readouterr().out.strip().splitlines()
    assert [json.loads(x) for x in out.read_text().splitlines()] == local
    assert lines[2:] == local_lines[1:] and "weight_version=4" in lines[1]


def test_config_vllm_without_vllm_is_one_error_line(tiny_model_dir, tmp_path, capsys):
    """rollout.engine=vllm launches through the backend, which names the missing env."""
    config = tmp_path / "run.yaml"
    missing = tmp_path / "no-vllm" / "python"
    config.write_text(
        f"model:\n  path: {tiny_model_dir}\nrollout:\n  engine: vllm\n  vllm:\n"
        f"    python: {missing}\n"
    )
    code = main(["eval", "--config", str(config), "--data", "arithmetic", "--limit", "1"])
    err = capsys.readouterr().err.strip().splitlines()
    assert code != 0 and len(err) == 1, err
    assert err[0].startswith(f"error: rollout.vllm.python: {missing} is not an executable file")


def test_no_model_and_no_config_is_one_error_line(capsys):
    code = main(["eval", "--data", "arithmetic"])
    err = capsys.readouterr().err.strip().splitlines()
    assert code != 0
    assert err == ["error: --model: required (or a --config whose model.path is set)"]


def test_the_servers_context_length_bounds_the_prompts(serve, tiny_model_dir, tmp_path, capsys):
    """Prompts that leave no room in the server's max_seq_len are not sent: too_long."""
    from relayrl.models.loading import encode_prompt, load_tokenizer
    from relayrl.tasks.registry import make_task

    tokenizer = load_tokenizer(tiny_model_dir)
    lengths = [
        len(encode_prompt(tokenizer, p.prompt))
        for p in make_task("arithmetic").problems("test", 5, seed=0)
    ]
    context = sorted(lengths)[len(lengths) // 2] + 1  # some prompts fit, some do not
    too_long = sum(n >= context for n in lengths)
    assert 0 < too_long < len(lengths)
    url = serve(max_seq_len=context)
    rows, lines = eval_rows(tiny_model_dir, tmp_path, capsys, "short", "--server-url", url)
    assert f"too_long_for_context={too_long}" in lines[0]
    assert [r["too_long"] for r in rows] == [n >= context for n in lengths]


def test_weights_published_after_connecting_reject_the_evaluation(serve, tiny_model_dir):
    """The per-token versions come over the wire: weights loaded on the server after the
    engine read its version make :func:`evaluate` refuse the answers."""
    import asyncio

    from relayrl.config.schema import EvalConfig
    from relayrl.engine.client import RolloutClient
    from relayrl.eval.evaluate import WeightsChanged, evaluate
    from relayrl.eval.remote import RemoteEngine
    from relayrl.models.loading import load_tokenizer
    from relayrl.tasks.registry import make_task

    url = serve()
    tokenizer = load_tokenizer(tiny_model_dir)
    problems = make_task("arithmetic").problems("test", 2, seed=0)
    cfg = EvalConfig(num_problems=2, n_samples=1, temperature=1.0, max_new_tokens=4)
    with RemoteEngine(lambda: RolloutClient(url)) as engine:
        assert engine.weight_version == 0
        assert evaluate(engine, tokenizer, problems, cfg).weight_version == 0

        async def publish() -> None:
            async with RolloutClient(url) as client:
                await client.update_weights(str(tiny_model_dir), version=1)

        asyncio.run(publish())
        with pytest.raises(WeightsChanged, match=r"started on version 0, tokens of version \[1\]"):
            evaluate(engine, tokenizer, problems, cfg)
