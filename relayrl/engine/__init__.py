"""Generation engine and rollout server: continuous batching over any Hugging Face causal
LM with per-token logprobs and weight versions, interruptible weight updates, the
SGLang-style HTTP server (with OpenAI-compatible ``/v1`` routes and vLLM's token-in,
token-out route), the async rollout client and its vLLM variant, and the receiving side of
weight transfers.

Imports: torch, transformers, fastapi/uvicorn/httpx, safetensors, relayrl.models,
relayrl.runkey, relayrl.errors, relayrl.heap; never relayrl.rewards or relayrl.report (its independent
siblings) nor any layer above.
"""
