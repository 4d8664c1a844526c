"""Generation engine and rollout server: continuous batching over any Hugging Face causal
LM with per-token logprobs and weight versions, interruptible weight updates, the SGLang-style
HTTP server and its async client.

Imports: torch, transformers, fastapi/uvicorn/httpx, relayrl.models, relayrl.errors.
"""
