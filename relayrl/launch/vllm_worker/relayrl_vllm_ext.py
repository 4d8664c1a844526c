"""A vLLM worker extension that runs inside the vLLM environment (not relayrl's): the
launcher puts this directory on the vLLM server's ``PYTHONPATH`` and passes
``--worker-extension-cls relayrl_vllm_ext.RelayWeightLoader``. It must import nothing from
relayrl (which is not installed there).

Why: vLLM 0.32's ``reload_weights`` reloads a layer in place and re-runs its weight
processing only when the checkpoint holds that layer's weights. A tied LM head
(``tie_word_embeddings``: its weight is the embedding's, absent from the checkpoint) is
skipped, and on CPU it keeps the GEMM handle that ``dispatch_cpu_unquantized_gemm`` built
over the *old* weights: the embedding changes, the output projection does not, and behaviour
logprobs drift from the trainer's after the first publication (measured: up to 0.8 nats on
the demo model). :meth:`RelayWeightLoader.relayrl_load_weights` reloads, then rebuilds those
handles over the current weights, so what the server samples from is exactly what was
published.
"""

from __future__ import annotations


class RelayWeightLoader:
    """Mixed into vLLM's worker class; called as ``collective_rpc("relayrl_load_weights")``."""

    def relayrl_load_weights(self, weights_path: str) -> dict:
        self.model_runner.reload_weights(weights_path=weights_path)
        model = self.model_runner.get_model()
        return {"rebuilt_cpu_gemm": _rebuild_cpu_gemm(model)}


def _rebuild_cpu_gemm(model) -> int:
    """Rebuild the CPU GEMM handle of every layer that kept its weight (embeddings, LM head);
    layers whose weight was moved into the handle were rebuilt by the reload itself."""
    try:
        from vllm.model_executor.layers.utils import dispatch_cpu_unquantized_gemm
    except ImportError:  # a vLLM without CPU GEMM dispatch: nothing cached
        return 0
    rebuilt = 0
    for module in model.modules():
        weight = getattr(module, "weight", None)
        if hasattr(module, "cpu_linear") and weight is not None and weight.ndim == 2:
            if weight.numel() and not weight.is_meta:
                dispatch_cpu_unquantized_gemm(module, remove_weight=False)
                rebuilt += 1
    return rebuilt
