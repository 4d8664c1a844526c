import json

from transformers import AutoModelForCausalLM, AutoTokenizer

from relayrl.cli import main
from relayrl.config.loader import load_config
from relayrl.models.loading import encode_prompt
from relayrl.tasks.registry import make_task
from relayrl.train.sft import IGNORE_INDEX, collate, demonstration_task, encode_example


def test_prompt_tokens_are_masked_and_eos_is_learned(tiny_model_dir):
    tok = AutoTokenizer.from_pretrained(tiny_model_dir)
    ids, labels = encode_example(tok, "Start at 3, then +4. What is the result?", "3+4=7\n#### 7")
    prompt_len = len(encode_prompt(tok, "Start at 3, then +4. What is the result?"))
    assert labels[:prompt_len] == [IGNORE_INDEX] * prompt_len
    assert labels[prompt_len:] == ids[prompt_len:]
    assert ids[-1] == tok.eos_token_id
    assert tok.decode(ids[prompt_len:-1]) == "3+4=7\n#### 7"
    batch_ids, mask, batch_labels = collate([(ids, labels), (ids[:5], labels[:5])], 0)
    assert batch_ids.shape == (2, len(ids)) and mask[1].sum() == 5
    assert (batch_labels[1, 5:] == IGNORE_INDEX).all()


def test_chat_template_is_applied_when_present(tiny_model_dir, tmp_path):
    tok = AutoTokenizer.from_pretrained(tiny_model_dir)
    plain = encode_prompt(tok, "Use 1, 2 to make 3.")
    assert tok.decode(plain) == "Use 1, 2 to make 3.\n"
    tok.chat_template = (
        "{% for m in messages %}[{{ m['role'] }}] {{ m['content'] }}\n{% endfor %}"
        "{% if add_generation_prompt %}[assistant] {% endif %}"
    )
    tok.save_pretrained(tmp_path)
    reloaded = AutoTokenizer.from_pretrained(tmp_path)
    ids = encode_prompt(reloaded, "Use 1, 2 to make 3.")
    assert reloaded.decode(ids) == "[user] Use 1, 2 to make 3.\n[assistant] "


def test_sft_command_end_to_end(tmp_path, capsys):
    code = main(
        [
            "sft",
            "configs/sft.yaml",
            f"output_dir={tmp_path}",
            "name=t",
            "model.preset=tiny",
            "sft.steps=20",
            "sft.batch_size=16",
            "eval.num_problems=20",
            "runtime.threads=1",
            "task.train_size=200",
        ]
    )
    assert code == 0
    out = capsys.readouterr().out.strip().splitlines()
    assert out[-1].startswith("base_pass@1=")
    run = tmp_path / "t"
    assert (run / "config.yaml").is_file() and "steps: 20" in (run / "config.yaml").read_text()
    summary = json.loads((run / "sft_summary.json").read_text())
    assert f"{summary['base_pass@1']:.2f}" == out[-1].split("=")[1]
    assert sum(1 for _ in open(run / "sft_eval.jsonl")) == 20
    model = AutoModelForCausalLM.from_pretrained(run / "sft_model")
    assert type(model).__name__ == "Qwen3ForCausalLM"


def test_sft_task_params_change_only_the_demonstrations():
    """``sft.task_params`` reshapes the demonstrations (tail 1: every chain as long as it
    may be), never the held-out split (chosen by key: no test problem is demonstrated)."""
    config = load_config(None, ["sft.task_params={tail: 1.0}"])
    demo = demonstration_task(config).problems("train", 300, 0)
    assert {len(p.meta["ops"]) for p in demo} == {6}
    default = make_task(config.task.name, config.task.params)
    assert len({len(p.meta["ops"]) for p in default.problems("train", 300, 0)}) == 5
    test_prompts = {p.prompt for p in default.problems("test", 500, 0)}
    assert test_prompts.isdisjoint(
        p.prompt for p in demonstration_task(config).problems("train", 5000, 0)
    )


def test_demonstrations_use_the_task_defaults_under_the_users_params():
    """Arithmetic demonstrates long chains more often than it asks them (its
    ``demonstration_params``: tail 0.65 over the task's 0.5); ``task.params`` and then
    ``sft.task_params`` override that default."""
    assert demonstration_task(load_config(None, [])).tail == 0.65
    assert make_task("arithmetic").tail == 0.5
    assert demonstration_task(load_config(None, ["task.params={tail: 0.3}"])).tail == 0.3
    both = ["task.params={tail: 0.3}", "sft.task_params={tail: 0.9}"]
    assert demonstration_task(load_config(None, both)).tail == 0.9
    countdown = demonstration_task(load_config(None, ["task.name=countdown"]))
    assert countdown.name == "countdown"
