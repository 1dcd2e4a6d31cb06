"""vLLM worker extension for bridge mode `shared`: vLLM's parameters become the trainer's memory.

Launched as `--worker-extension-cls grpod.weights.shared_ext.SharedWeightsExtension`; vLLM mixes
the class into its Worker and `collective_rpc` calls its methods there (string arguments only).

Import side effect, on CPU only: vLLM's CPU linear layers normally hand their weights to oneDNN
(or the SGL kernel) after loading, then drop the tensors (the parameters become empty `[0]`), and
its output head (the embedding kept for lookup) computes logits from oneDNN's packed copy, so an
in-place edit of it is ignored. Importing this module swaps
`vllm.model_executor.layers.utils.dispatch_cpu_unquantized_gemm` for one that gives every 2-D
linear weight `torch.nn.functional.linear` as its `cpu_linear`: the layer then multiplies by
`layer.weight` itself, each call, so re-pointing that parameter is all it takes. vLLM resolves the
extension class in `WorkerWrapperBase.init_worker`, before it builds the worker and loads the
model, and `process_weights_after_loading` looks the dispatch function up at call time, so the
swap is in place before any layer is dispatched. `attach_shared` checks it took (a layer with
another `cpu_linear` is an error naming it). Measured cost: see bench/shared_linear.py.

Private names would be checked against the Worker's attributes too (vLLM refuses a conflict), so
the helpers are module functions and the class holds only the RPC methods.
"""

from __future__ import annotations

import gc
import os
from pathlib import Path

import torch
import torch.nn.functional as F

from grpod.inference.threads_ext import EngineThreads
from grpod.weights.shared_layout import (
    SharedLayout,
    SharedLayoutError,
    device_uuid,
    lies_within,
    open_shared_buffer,
    return_freed_memory_to_os,
)


def _linear_weights_stay_tensors(stock):
    """The CPU gemm dispatch, changed to keep 2-D weights as tensors multiplied by F.linear."""

    def dispatch(layer: torch.nn.Module, remove_weight: bool) -> None:
        if layer.weight.ndim != 2 or layer.weight.is_meta:
            return stock(layer, remove_weight)
        layer.cpu_linear = F.linear

    dispatch.stock = stock
    return dispatch


def _install_plain_linear() -> None:
    from vllm.platforms import current_platform

    if not current_platform.is_cpu():
        return
    import vllm.model_executor.layers.utils as layer_utils

    stock = getattr(layer_utils, "dispatch_cpu_unquantized_gemm", None)
    if stock is None:
        raise ImportError(
            "vllm.model_executor.layers.utils.dispatch_cpu_unquantized_gemm is gone in this vLLM version: "
            "grpod cannot keep CPU linear weights as tensors, so bridge.mode = 'shared' cannot work; "
            "use bridge.mode = 'none' or the vLLM version grpod pins"
        )
    if not hasattr(stock, "stock"):
        layer_utils.dispatch_cpu_unquantized_gemm = _linear_weights_stay_tensors(stock)


_install_plain_linear()

# The buffer this worker's parameters were last attached to (for `shared_weights_report`).
_attached: dict[str, torch.Tensor] = {}


def _check_dispatch(model: torch.nn.Module) -> None:
    for name, module in model.named_modules():
        linear = getattr(module, "cpu_linear", None)
        if linear is not None and linear is not F.linear:
            raise SharedLayoutError(
                f"vLLM layer {name} computes with {getattr(linear, '__name__', linear)!r} instead of its weight "
                "tensor (the grpod worker extension was imported after the model loaded?): edits of its "
                "weight would not be seen"
            )


def _check_device(layout: SharedLayout, device: torch.device) -> None:
    if layout.storage != "cuda_ipc":
        return
    if device.type != "cuda":
        raise SharedLayoutError(f"the trainer shares CUDA memory but vLLM's weights are on {device}")
    mine = device_uuid(device)
    if mine != layout.device_uuid:
        raise SharedLayoutError(
            f"shared mode on GPU needs the trainer and vLLM on the same device: the trainer is on "
            f"{layout.device_uuid}, vLLM's worker on {mine}; set train.device and CUDA_VISIBLE_DEVICES so both see it"
        )


def attach_model(model: torch.nn.Module, directory: Path, *, verify_values: bool) -> dict:
    """Re-point every parameter of vLLM's `model` at its slot of the trainer's shared buffer."""
    layout = SharedLayout.load(directory)
    params = dict(model.named_parameters())
    slots = {s.name: s for s in layout.slots}
    unmapped = sorted(set(params) - set(slots))
    if unmapped:
        raise SharedLayoutError(
            f"vLLM parameters with no slot in the trainer's layout: {', '.join(unmapped)} "
            f"(the layout has {', '.join(sorted(set(slots) - set(params))) or 'nothing else'})"
        )
    unused = sorted(set(slots) - set(params))
    if unused:
        raise SharedLayoutError(f"the trainer shares {', '.join(unused)}, which vLLM's model does not have")
    device = next(iter(params.values())).device
    _check_device(layout, device)
    if device.type == "cpu":
        _check_dispatch(model)
    flat = open_shared_buffer(directory, layout)
    views = {}
    for name, param in params.items():
        slot = slots[name]
        view = slot.view(flat)
        if tuple(param.shape) != slot.shape or param.dtype != layout.torch_dtype:
            raise SharedLayoutError(
                f"vLLM parameter {name} is {tuple(param.shape)} {param.dtype}, the trainer shares "
                f"{slot.shape} {layout.dtype}: different models or dtypes (shared mode needs model.dtype = 'float32')"
            )
        if verify_values and not torch.equal(param.data, view):
            diff = (param.data.float() - view.float()).abs().max().item()
            raise SharedLayoutError(
                f"vLLM parameter {name} differs from the trainer's rows for it by up to {diff:.3g}: the layout "
                "does not match how vLLM loaded this model"
            )
        views[name] = view
    for name, param in params.items():
        param.data = views[name]
    _attached["flat"] = flat
    del views
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()
    else:
        return_freed_memory_to_os()
    return {"pid": os.getpid(), "parameters": len(params), "bytes": layout.nbytes, "device": str(device)}


def shared_report(model: torch.nn.Module) -> dict:
    """Which of vLLM's parameters lie outside the attached shared buffer (none, once attached)."""
    flat = _attached.get("flat")
    outside = [name for name, p in model.named_parameters() if flat is None or not lies_within(p, flat)]
    return {"pid": os.getpid(), "outside": outside}


class SharedWeightsExtension(EngineThreads):
    """RPC methods vLLM's Worker gains (`collective_rpc(method, args=[...])`)."""

    def attach_shared(self, directory: str, verify_values: str = "true") -> dict:
        """Map the trainer's shared weights in `directory` into this worker's model.

        `verify_values="true"` also requires vLLM's loaded values to equal the trainer's (right
        after vLLM loaded the checkpoint the trainer loaded); a relaunch onto weights that have
        trained since passes "false". Returns pid, parameter count, bytes, device.
        """
        return attach_model(self.model_runner.get_model(), Path(directory), verify_values=verify_values == "true")

    def shared_weights_report(self) -> dict:
        """This worker's pid and the names of its parameters that do NOT lie in the shared buffer."""
        return shared_report(self.model_runner.get_model())
