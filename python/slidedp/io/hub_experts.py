"""The hub's per-expert layout of mixture-of-experts checkpoints, mapped onto the model's fused
expert parameters ``mlp.experts.gate_up_proj`` [E, 2I, H] and ``mlp.experts.down_proj`` [E, H, I].

Hub checkpoints keep one tensor per expert and projection (``...experts.E.{gate_proj,up_proj,
down_proj}.weight``; Mixtral ``block_sparse_moe.experts.E.{w1,w3,w2}``). Each names its ``Slot``,
a slice of a fused parameter (gate ``gate_up_proj[e, :I]``, up ``gate_up_proj[e, I:]``,
``down_proj[e]``), as transformers' ``conversion_mapping.py`` fuses them on load; ``io.hf_load``
copies tensor by tensor, never assembling a layer's experts outside the store.

Example::

    hub = HubLayout.of(adapter.config.model_type, adapter.shapes())  # None: a dense model
    hub.slot("model.layers.0.block_sparse_moe.experts.3.w3.weight")  # up of expert 3: a
    # Slot of target 'model.layers.0.mlp.experts.gate_up_proj', rows=(I, 2 * I)
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class HubNames:
    """One model type's per-expert names: the MoE block's module in the checkpoint (the model's
    is ``mlp``) and its three projections, gate and up (fused in that order) and down."""

    block: str
    gate: str
    up: str
    down: str


HUB_NAMES = {
    "qwen3_moe": HubNames("mlp", "gate_proj", "up_proj", "down_proj"),
    "qwen3_5_moe_text": HubNames("mlp", "gate_proj", "up_proj", "down_proj"),
    "olmoe": HubNames("mlp", "gate_proj", "up_proj", "down_proj"),
    "mixtral": HubNames("block_sparse_moe", "w1", "w3", "w2"),
}
GATE_UP = "mlp.experts.gate_up_proj"  # [E, 2I, H], gate rows first
DOWN = "mlp.experts.down_proj"  # [E, H, I]


@dataclass(frozen=True)
class Slot:
    """Where one checkpoint tensor goes: the stored parameter ``target``, whole (``expert``
    None), or expert ``expert``'s matrix of a fused one, its rows ``rows`` (gate or up of
    ``gate_up_proj``) or all of it (``down_proj``). ``shape``: what the tensor must have."""

    target: str
    shape: tuple[int, ...]
    expert: int | None = None
    rows: tuple[int, int] | None = None

    def view(self, param: torch.Tensor) -> torch.Tensor:
        """The part of ``param`` (the target's store view) this slot is: a view, no copy."""
        if self.expert is None:
            return param
        part = param[self.expert]
        return part if self.rows is None else part[self.rows[0] : self.rows[1]]


class HubLayout:
    """Every hub tensor name of one MoE model with its ``Slot``, and the names that fill each
    fused expert parameter (``parts``), from the model's parameter shapes."""

    def __init__(self, names: HubNames, shapes: dict[str, tuple[int, ...]]) -> None:
        self.names = names
        self.fused: set[str] = set()  # the fused expert parameters
        self._parts: dict[str, dict[str, Slot]] = {}  # fused target -> {hub name: slot}
        self._slots: dict[str, Slot] = {}  # hub name -> slot
        for target, shape in shapes.items():
            if not target.startswith("model.layers."):
                continue
            layer, _, local = target.removeprefix("model.layers.").partition(".")
            hub = f"model.layers.{layer}.{names.block}.experts"
            if local == GATE_UP:
                experts, two_i, hidden = shape
                i = two_i // 2
                parts = {}
                for e in range(experts):
                    parts[f"{hub}.{e}.{names.gate}.weight"] = Slot(target, (i, hidden), e, (0, i))
                    parts[f"{hub}.{e}.{names.up}.weight"] = Slot(target, (i, hidden), e, (i, two_i))
            elif local == DOWN:
                parts = {f"{hub}.{e}.{names.down}.weight": Slot(target, shape[1:], e)
                         for e in range(shape[0])}  # fmt: skip
            else:
                if names.block != "mlp" and local.startswith("mlp."):  # Mixtral's router
                    renamed = f"model.layers.{layer}.{names.block}.{local.removeprefix('mlp.')}"
                    self._slots[renamed] = Slot(target, shape)
                continue
            self.fused.add(target)
            self._parts[target] = parts
            self._slots.update(parts)

    @classmethod
    def of(cls, model_type: str, shapes: dict[str, tuple[int, ...]]) -> HubLayout | None:
        """The layout of ``model_type`` (None for a model without hub expert names)."""
        names = HUB_NAMES.get(model_type)
        return None if names is None else cls(names, shapes)

    def slot(self, name: str) -> Slot | None:
        """Where the hub tensor ``name`` goes; None for a name that is not one."""
        return self._slots.get(name)

    def is_expert(self, name: str) -> bool:
        """``name`` is one expert's projection (not a renamed whole parameter)."""
        slot = self._slots.get(name)
        return slot is not None and slot.expert is not None

    def parts(self, target: str) -> dict[str, Slot]:
        """The hub tensors that together fill the fused parameter ``target`` ({} for others)."""
        return self._parts.get(target, {})
