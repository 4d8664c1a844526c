"""A vLLM worker extension that runs inside the vLLM environment (not relayrl's): the
launcher puts this directory and ``relayrl/engine/wire`` on the vLLM server's ``PYTHONPATH``
and passes ``--worker-extension-cls relayrl_vllm_ext.RelayWeightLoader``. It must import
nothing from relayrl (which is not installed there) but the wire modules
``relayrl_transfer_wire`` (the standard library and torch only), which relayrl's side of the
broadcast transport loads too: the same buckets, in the same order, on both ends, and
``relayrl_peft_wire`` (the PEFT directory relayrl writes for an adapter publication).

Its methods are called through vLLM's ``POST /collective_rpc`` (``relayrl.engine.vllm_client``):

* ``relayrl_load_weights(weights_path)``: the disk transport (the snapshot is read here, so
  its checksum is computed over exactly the tensors loaded);
* ``relayrl_join_group(...)`` and ``relayrl_receive_weights(...)``: the broadcast transport
  (join the trainer's gloo transfer group; receive one publication from it and load it);
* ``relayrl_leave_group()``;
* ``relayrl_lora_setup()`` (``model.lora``, before each adapter load): vLLM 0.32 reloads an
  adapter from its directory on every engine step that runs a request whose adapter was
  loaded ``load_inplace`` (the flag travels with each request), which is slow and, with
  requests of two publications in one step, flips between their adapters; after this call a
  step only activates the adapter the server holds, and only a load replaces it;
* ``relayrl_base_adapter()`` (``model.lora``): write a zero LoRA adapter for this server's
  model (one output projection, A = B = 0: it adds exactly nothing) as a PEFT directory on
  the server's own filesystem, for the client to load as the served adapter before the first
  publication (relayrl.engine.vllm_client: every request names the adapter from the start).

Every load reports ``checksum``: ``served_checksum`` of the tensors it loaded, rounded to the
model's dtype as loading rounds them (a bf16 server given fp32 weights), which
relayrl's publication transaction compares with the trainer's (proof that the weights
delivered are the ones published). A publication is received whole before anything is loaded, so a broadcast that fails midway
(the trainer left the group, a deadline passed) leaves the served weights as they were. The
received tensors are loaded exactly as a disk snapshot is: through vLLM's in-place
``reload_weights``, i.e. the model's own ``load_weights`` (vLLM's name mapping, fused qkv and
gate_up packing) inside its layerwise-reload lifecycle, as vLLM's own weight-transfer engines
do. The broadcast methods report a failure as ``{"success": false, "error": ...}`` rather
than raising, so the message reaches the trainer (an exception in a collective RPC comes back
from vLLM's HTTP server as a bare 500).

Why the CPU GEMM rebuild: vLLM 0.32's ``reload_weights`` reloads a layer in place and re-runs
its weight processing only when the checkpoint holds that layer's weights. A tied LM head
(``tie_word_embeddings``: its weight is the embedding's, absent from the checkpoint) is
skipped, and on CPU it keeps the GEMM handle that ``dispatch_cpu_unquantized_gemm`` built
over the *old* weights: the embedding changes, the output projection does not, and behaviour
logprobs drift from the trainer's after the first publication (measured: up to 0.8 nats on
the demo model). Every load therefore rebuilds those handles over the current weights, so
what the server samples from is exactly what was published.
"""

from __future__ import annotations

from typing import Any

import torch
from relayrl_peft_wire import write_peft
from relayrl_transfer_wire import WireGroup, dtype_from_name, served_checksum

BASE_ADAPTER_MODULES = ("o_proj", "down_proj", "dense")  # unpacked projections vLLM adapts


class RelayWeightLoader:
    """Mixed into vLLM's worker class; see the module docstring for its RPC methods."""

    _relayrl_group: WireGroup | None = None  # the transfer group joined, if any

    def relayrl_load_weights(self, weights_path: str) -> dict:
        return self._relayrl_reload(_read_snapshot(weights_path))

    def relayrl_join_group(
        self,
        master_address: str,
        master_port: int,
        rank_offset: int,
        world_size: int,
        group_name: str,
        timeout_s: float,
        secret: str | None = None,
    ) -> dict:
        """Leave any group joined before, then join ``group_name`` as rank ``rank_offset``
        (blocks until every rank is in, or ``timeout_s``); ``secret``: the trainer's
        rendezvous secret (derived from the run key; never this server's own key)."""
        self.relayrl_leave_group()
        try:
            self._relayrl_group = WireGroup.join(
                master_address,
                int(master_port),
                int(rank_offset),
                int(world_size),
                group_name,
                float(timeout_s),
                secret or None,
            )
        except Exception as exc:  # noqa: BLE001 - reported to the trainer, see the docstring
            return {"success": False, "error": str(exc)}
        return {"success": True, "rank": int(rank_offset)}

    def relayrl_receive_weights(
        self, group_name: str, names: list[str], dtypes: list[str], shapes: list[list[int]]
    ) -> dict:
        """Receive one publication (one tensor per name, in this order) from rank 0 of the
        joined group ``group_name``, then load it; a failed receive leaves the group."""
        group = self._relayrl_group
        if group is None or group.name != group_name:
            joined = "no group" if group is None else f"group {group.name!r}"
            return {
                "success": False,
                "error": f"group_name: {group_name!r} is not the joined transfer group (this "
                f"server has {joined}); join it first",
            }
        try:
            specs = [
                (n, dtype_from_name(d), [int(x) for x in s])
                for n, d, s in zip(names, dtypes, shapes, strict=True)
            ]
            state = group.receive(specs)
        except Exception as exc:  # noqa: BLE001 - reported to the trainer
            self.relayrl_leave_group()  # a broken group is never used again
            error = f"the broadcast in group {group_name!r} failed ({exc}); the group is left"
            return {"success": False, "error": error}
        try:
            out = self._relayrl_reload(state)
        except Exception as exc:  # noqa: BLE001 - e.g. a name the model does not have
            return {"success": False, "error": f"loading the received weights failed: {exc}"}
        return {"success": True, "tensors": len(state), **out}

    def relayrl_leave_group(self) -> dict:
        group, self._relayrl_group = self._relayrl_group, None
        if group is not None:
            group.close()
        return {"success": True, "left": group.name if group is not None else None}

    def relayrl_lora_setup(self) -> dict:
        """See the module docstring; idempotent."""
        manager = getattr(self.model_runner, "lora_manager", None)
        apply = getattr(manager, "_apply_adapters", None)
        if apply is None:
            return {
                "success": False,
                "error": "this server has no LoRA manager with _apply_adapters (started "
                "without --enable-lora, or a vLLM other than 0.32)",
            }
        if not getattr(manager, "_relayrl_step_reload_off", False):
            import msgspec

            def apply_held(requests: set) -> None:
                held = {
                    msgspec.structs.replace(r, load_inplace=False) if r and r.load_inplace else r
                    for r in requests
                }
                apply(held)

            manager._apply_adapters = apply_held
            manager._relayrl_step_reload_off = True
        return {"success": True}

    def relayrl_base_adapter(self) -> dict:
        """A zero LoRA adapter (see the module docstring) written as a PEFT directory; its
        path, or ``success: false`` naming why (a model with no projection named in
        :data:`BASE_ADAPTER_MODULES`)."""
        import atexit
        import shutil
        import tempfile
        from pathlib import Path

        for name, module in self.model_runner.get_model().named_modules():
            base = getattr(module, "base_layer", module)  # vLLM's LoRA wrapper, if any
            sizes = getattr(base, "input_size", None), getattr(base, "output_size", None)
            if name.rsplit(".", 1)[-1] in BASE_ADAPTER_MODULES and None not in sizes:
                directory = getattr(self, "_relayrl_base_dir", None)
                if directory is None:
                    # a fresh 0700 directory (never a predictable /tmp path another local
                    # user could plant an adapter at), removed when the worker exits; a
                    # killed worker's goes with its launcher's TMPDIR (ServerLauncher.stop)
                    directory = Path(tempfile.mkdtemp(prefix="relayrl-base-adapter-"))
                    atexit.register(shutil.rmtree, directory, ignore_errors=True)
                    pairs = {name: (torch.zeros(1, int(sizes[0])), torch.zeros(int(sizes[1]), 1))}
                    write_peft(pairs, 1.0, directory)
                    self._relayrl_base_dir = directory
                return {"success": True, "path": str(directory), "module": name}
        return {
            "success": False,
            "error": f"no LoRA-able projection named {BASE_ADAPTER_MODULES} in the model",
        }

    def _relayrl_reload(self, state: dict[str, torch.Tensor]) -> dict[str, Any]:
        """vLLM's in-place reload of ``state``, then the CPU GEMM rebuild; reports the
        checksum of the weights it loaded (the publisher compares it with the trainer's)."""
        # of the tensors as this server holds them (rollout.dtype), the trainer's rule
        checksum = served_checksum(state.items(), self.model_runner.model_config.dtype)
        self.model_runner.reload_weights(weights_iterator=iter(state.items()))
        rebuilt = _rebuild_cpu_gemm(self.model_runner.get_model())
        return {"success": True, "rebuilt_cpu_gemm": rebuilt, "checksum": checksum}


def _read_snapshot(weights_path: str) -> dict[str, torch.Tensor]:
    """Every tensor of a disk snapshot (a ``.safetensors`` file or a directory of them)."""
    from pathlib import Path

    from safetensors.torch import load_file

    path = Path(weights_path)
    files = [path] if path.is_file() else sorted(path.glob("*.safetensors"))
    if not files:
        raise FileNotFoundError(f"no *.safetensors under {weights_path}")
    state: dict[str, torch.Tensor] = {}
    for file in files:
        state.update(load_file(str(file)))
    return state


def _rebuild_cpu_gemm(model: torch.nn.Module) -> int:
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
