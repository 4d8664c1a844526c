import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from relayrl.models.factory import PRESETS, build_config, count_parameters
from relayrl.models.tokenizer import train_tokenizer
from relayrl.tasks.registry import make_task


def test_saved_model_reloads_with_identical_logits(tiny_model_dir):
    tok = AutoTokenizer.from_pretrained(tiny_model_dir)
    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir).eval()
    again = AutoModelForCausalLM.from_pretrained(tiny_model_dir).eval()
    ids = torch.tensor([tok("Start at 17, then +5, *3. What is the result?")["input_ids"]])
    with torch.no_grad():
        assert torch.equal(model(ids).logits, again(ids).logits)
    assert type(model).__name__ == "Qwen3ForCausalLM"


def test_tokenizer_round_trips_task_text(tiny_model_dir):
    tok = AutoTokenizer.from_pretrained(tiny_model_dir)
    task = make_task("countdown")  # text the tokenizer was not trained on
    import random

    rng = random.Random(0)
    for problem in task.problems("test", 50, seed=3):
        for text in (problem.prompt, task.demonstration(problem, rng)):
            ids = tok(text, add_special_tokens=False)["input_ids"]
            assert tok.decode(ids) == text
    # digits are single tokens
    assert len(tok("12345", add_special_tokens=False)["input_ids"]) == 5


def test_tokenizer_has_special_tokens():
    tok = train_tokenizer(["1+2=3\n#### 3", "Start at 4, then +5."], vocab_size=300)
    assert tok.eos_token == "<eos>" and tok.pad_token == "<pad>"
    assert tok.decode(tok("7*8=56\n#### 56")["input_ids"]) == "7*8=56\n#### 56"


def test_presets_have_the_documented_sizes():
    from transformers import Qwen3ForCausalLM

    expected = {"tiny": 0.4e6, "small": 3e6, "medium": 25e6}
    for name, target in expected.items():
        cfg = build_config(
            name,
            vocab_size=384,
            max_position_embeddings=512,
            bos_token_id=None,
            eos_token_id=1,
            pad_token_id=0,
        )
        with torch.device("meta"):
            n = count_parameters(Qwen3ForCausalLM(cfg))
        assert 0.6 * target < n < 1.4 * target, (name, n)
    assert set(expected) <= set(PRESETS)
