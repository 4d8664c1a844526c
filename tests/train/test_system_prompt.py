"""``model.system_prompt``: one system message before every prompt, in SFT's demonstrations,
the run's rollouts and its evaluation — the chat template's system turn, a first paragraph
without a template, and one error naming the key when a template refuses a system turn."""

from __future__ import annotations

import random

import pytest
from transformers import AutoTokenizer

from relayrl.config.loader import load_config
from relayrl.config.schema import EvalConfig
from relayrl.engine.engine import Engine
from relayrl.engine.types import EngineOptions
from relayrl.errors import RelayError
from relayrl.eval.evaluate import evaluate
from relayrl.models.loading import encode_prompt, load_model
from relayrl.tasks.registry import make_task
from relayrl.train.run.setup import RunSetup
from relayrl.train.sft import IGNORE_INDEX, DemonstrationStream

SYSTEM = "Answer with a worked chain."
TAGGED = (
    "{% for m in messages %}[{{ m['role'] }}] {{ m['content'] }}\n{% endfor %}"
    "{% if add_generation_prompt %}[assistant] {% endif %}"
)
NO_SYSTEM = (  # Gemma-style: a system turn is refused by the template itself
    "{% if messages[0]['role'] == 'system' %}{{ raise_exception('System role not supported') }}"
    "{% endif %}" + TAGGED
)


@pytest.fixture
def tokenizer(tiny_model_dir):
    return AutoTokenizer.from_pretrained(tiny_model_dir)


def test_the_system_prompt_is_the_templates_system_turn(tokenizer):
    plain = encode_prompt(tokenizer, "Start at 3. Steps: a +4.", SYSTEM)
    assert tokenizer.decode(plain) == f"{SYSTEM}\n\nStart at 3. Steps: a +4.\n"
    tokenizer.chat_template = TAGGED
    ids = encode_prompt(tokenizer, "Start at 3. Steps: a +4.", SYSTEM)
    assert (
        tokenizer.decode(ids) == f"[system] {SYSTEM}\n[user] Start at 3. Steps: a +4.\n[assistant] "
    )
    tokenizer.chat_template = NO_SYSTEM
    assert tokenizer.decode(encode_prompt(tokenizer, "x")) == "[user] x\n[assistant] "
    with pytest.raises(RelayError, match="model.system_prompt: .*System role not supported"):
        encode_prompt(tokenizer, "x", SYSTEM)


def test_sft_demonstrations_carry_it_masked(tokenizer):
    task = make_task("arithmetic")
    problems = task.problems("train", 4, seed=0)
    stream = DemonstrationStream(task, problems, tokenizer, 0.0, seed=0, system_prompt=SYSTEM)
    ids, labels = stream.next_batch(1)[0]
    prompt_len = labels.index(next(x for x in labels if x != IGNORE_INDEX))
    assert tokenizer.decode(ids[:prompt_len]).startswith(f"{SYSTEM}\n\nStart at ")
    assert tokenizer.decode(ids[prompt_len:-1]).rstrip().split("\n")[-1].startswith("#### ")


def test_rollouts_and_evaluation_use_it(tiny_model_dir, tokenizer, tmp_path):
    config = load_config(None, [f"model.system_prompt={SYSTEM}", f"output_dir={tmp_path}"])
    setup = RunSetup.build(config, tmp_path / "run", tiny_model_dir)
    problem = setup.task.problems("test", 1, seed=0)[0]
    assert tokenizer.decode(setup.encode(problem)) == f"{SYSTEM}\n\n{problem.prompt}\n"
    setup.logger.close()
    # evaluation: a context that holds the prompt alone but not with a long system prompt
    prompt_tokens = len(encode_prompt(tokenizer, problem.prompt))
    options = EngineOptions(max_seq_len=prompt_tokens + 8)
    cfg = EvalConfig(num_problems=1, n_samples=1, max_new_tokens=4)
    model = load_model(tiny_model_dir, "cpu", "float32")
    with Engine(model, tokenizer, options) as engine:
        without = evaluate(engine, tokenizer, [problem], cfg)
        long_system = " ".join(random.Random(0).choice("abc") for _ in range(40))
        with_system = evaluate(engine, tokenizer, [problem], cfg, system_prompt=long_system)
    assert not without.per_problem[0]["too_long"] and with_system.per_problem[0]["too_long"]
