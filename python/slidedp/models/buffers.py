"""Tensors a decoder layer holds that are not parameters: its buffers (Gemma 4's
``layer_scalar``, a constant scale per layer that checkpoints carry).

The skeleton lives on ``meta``, so the values are kept here on CPU: the model's own
``_init_weights`` first, then the checkpoint's (``io.hf_load``). Invariants: never trained;
checkpoints and the export write the persistent ones beside the master weights (``io.export``);
a layer runs with copies on its input's device bound in, the floating ones in the input's dtype
(``HFAdapter.run_layer``), as ``model.to(dtype)`` converts buffers.

Example::

    buffers = LayerBuffers.of(adapter.skeleton, adapter.base.layers)
    buffers.persistent      # {"model.layers.0.layer_scalar": (1,), ...}
    bind_buffers(module, buffers.on(0, x.device, x.dtype))
"""

from __future__ import annotations

import copy
from collections.abc import Sequence
from dataclasses import dataclass, field

import torch
from torch import nn
from transformers import PreTrainedModel


@dataclass(frozen=True)
class Buffer:
    layer: int
    local: str  # dotted name inside the layer module
    persistent: bool  # in the state dict: read from checkpoints, written with the weights


def bind_buffers(module: nn.Module, tensors: dict[str, torch.Tensor]) -> None:
    """Point ``module``'s buffers (local dotted names) at ``tensors`` without copying."""
    for local, tensor in tensors.items():
        path, _, attr = local.rpartition(".")
        owner = module.get_submodule(path) if path else module
        owner._buffers[attr] = tensor


def _initial(skeleton: PreTrainedModel, owner: nn.Module, attr: str) -> torch.Tensor:
    """``owner``'s buffer ``attr`` as ``_init_weights`` sets it: on a shallow copy of ``owner``
    whose buffers are CPU tensors (its parameters stay on meta, where init is a no-op)."""
    probe = copy.copy(owner)
    probe._buffers = {n: torch.zeros(b.shape, dtype=b.dtype)
                      for n, b in owner._buffers.items() if b is not None}  # fmt: skip
    skeleton._init_weights(probe)  # type: ignore[no-untyped-call]
    value = probe._buffers[attr]
    assert value is not None
    return value


@dataclass
class LayerBuffers:
    """Every decoder layer buffer by full HF name, its value and device copies."""

    buffers: dict[str, Buffer]
    values: dict[str, torch.Tensor]  # full name -> CPU value in the skeleton buffer's dtype
    _placed: dict[tuple[int, torch.device, torch.dtype], dict[str, torch.Tensor]] = field(
        default_factory=dict
    )

    @classmethod
    def of(cls, skeleton: PreTrainedModel, layers: Sequence[nn.Module]) -> LayerBuffers:
        buffers: dict[str, Buffer] = {}
        values: dict[str, torch.Tensor] = {}
        for i, layer in enumerate(layers):
            for path, owner in layer.named_modules():
                for attr, b in owner._buffers.items():
                    if b is None:
                        continue
                    local = f"{path}.{attr}" if path else attr
                    full = f"model.layers.{i}.{local}"
                    persistent = attr not in owner._non_persistent_buffers_set
                    buffers[full] = Buffer(i, local, persistent)
                    values[full] = _initial(skeleton, owner, attr)
        return cls(buffers, values)

    @property
    def persistent(self) -> dict[str, tuple[int, ...]]:
        """The buffers checkpoints carry: full name -> shape."""
        return {n: tuple(self.values[n].shape) for n, b in self.buffers.items() if b.persistent}

    def set(self, name: str, value: torch.Tensor) -> None:
        """A checkpoint's value of buffer ``name`` (shape checked by the caller)."""
        self.values[name] = value.to(self.values[name].dtype).clone()
        self._placed.clear()

    def on(self, layer: int, device: torch.device, dtype: torch.dtype) -> dict[str, torch.Tensor]:
        """Layer ``layer``'s buffers by local name on ``device``, the floating ones in ``dtype``
        (cached)."""
        key = (layer, device, dtype)
        if key not in self._placed:
            values = {b.local: self.values[n] for n, b in self.buffers.items() if b.layer == layer}
            self._placed[key] = {
                local: v.to(device=device, dtype=dtype if v.is_floating_point() else v.dtype)
                for local, v in values.items()
            }
        return self._placed[key]
