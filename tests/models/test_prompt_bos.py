"""A base model's prompt starts with the BOS its tokenizer adds of its own accord (Llama's,
Gemma's): Gemma 3 270M, which has no chat template, wrote no sense without it. A chat
template writes its own BOS, and a tokenizer that adds none gets none."""

from __future__ import annotations

from tokenizers import Tokenizer, models, pre_tokenizers, processors
from transformers import PreTrainedTokenizerFast

from relayrl.models.loading import encode_prompt, leading_special_ids
from relayrl.train.sft import encode_demonstrations

VOCAB = {"<pad>": 0, "<bos>": 1, "<eos>": 2, "<unk>": 3, "What": 4, "is": 5, "1": 6, "+": 7}


def tokenizer(adds_bos: bool, chat_template: str | None = None) -> PreTrainedTokenizerFast:
    raw = Tokenizer(models.WordLevel(VOCAB, unk_token="<unk>"))
    raw.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    if adds_bos:  # as Llama's and Gemma's tokenizer.json: BOS before every text
        raw.post_processor = processors.TemplateProcessing(
            single="<bos> $A", special_tokens=[("<bos>", 1)]
        )
    tok = PreTrainedTokenizerFast(
        tokenizer_object=raw, bos_token="<bos>", eos_token="<eos>", pad_token="<pad>"
    )
    tok.chat_template = chat_template
    return tok


def test_a_tokenizer_that_adds_bos_starts_every_plain_prompt_with_it():
    tok = tokenizer(adds_bos=True)
    assert leading_special_ids(tok) == [1]
    assert encode_prompt(tok, "What is 1 + 1") == [1, 4, 5, 6, 7, 6]
    # SFT's demonstrations begin as the rollouts' prompts do
    ((ids, labels),) = encode_demonstrations(tok, [("What is 1 + 1", [("1", True)])])
    assert ids == [1, 4, 5, 6, 7, 6, 6, 2] and labels[:6] == [-100] * 6


def test_no_bos_from_a_tokenizer_that_adds_none_nor_twice_under_a_chat_template():
    assert encode_prompt(tokenizer(adds_bos=False), "What is 1 + 1") == [4, 5, 6, 7, 6]
    template = "<bos> {% for m in messages %}{{ m['content'] }}{% endfor %}"
    tok = tokenizer(adds_bos=True, chat_template=template)
    assert leading_special_ids(tok) == []
    assert encode_prompt(tok, "What is 1 + 1") == [1, 4, 5, 6, 7, 6]  # the template's BOS
