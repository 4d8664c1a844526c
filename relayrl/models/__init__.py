"""Model and tokenizer factory: Qwen3-architecture size presets built from a config,
tokenizers trained on task text, and loading of any Hugging Face causal-LM directory.

Imports: torch, transformers, tokenizers, relayrl.config, relayrl.errors.
"""
