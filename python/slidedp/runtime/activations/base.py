"""What every checkpoint family shares: one layer's run, its saved state, the input's gradient.

An executor (``full``, ``segment``, ``selective``, ``none``) has ``forward(run, x) → (y,
state)`` and ``backward(run, state, g_y, g_extra) → (g_x, {local name: gradient})``; the
backward computes no gradient for ``run.frozen`` parameters (absent from the dict) and, without
``run.input_grad``, none for the input (``g_x`` is None).
``state.extra`` holds extra outputs (a mixture's router logits, detached), ``g_extra`` their
gradients (``()`` for none). ``state.tensors`` are the saved activations that may move to the
host, in save order (``None`` while offloaded); ``state.retained_bytes`` counts what stays on
the device outside them. Invariant: weights are never saved by value: a saved view of a
parameter is recorded as (name, size, stride, offset) and rebuilt from the slot the backward
loaded (``ParamAliases``); tensors shared by every layer (rotary cos/sin, masks) are kept by
reference.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch
from torch.autograd.graph import GradientEdge, get_gradient_edge

from slidedp.models.hf import HFAdapter


@dataclass
class LayerRun:
    """Decoder layer ``layer`` of ``adapter`` with its parameters bound to ``params`` (views of
    the slot loaded for this pass, module-local names) and the step's ``ctx`` (masks,
    positions, rotary)."""

    adapter: HFAdapter
    layer: int
    params: dict[str, torch.Tensor]
    ctx: dict[str, Any]
    # every call runs the modules themselves, never the compiled layer (``plan.cost``'s runs on
    # the meta device: inductor cannot partition a meta graph run under saved-tensor hooks)
    eager: bool = False
    frozen: frozenset[str] = frozenset()  # parameters that get no gradient (local names)
    input_grad: bool = True  # False: nothing below trains, the input's gradient is not needed

    def trained(self, params: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """The entries of ``params`` that get a gradient."""
        return {n: p for n, p in params.items() if n not in self.frozen}

    def differentiate(
        self,
        outputs: tuple[Any, tuple[Any, ...]],
        x: torch.Tensor,
        params: dict[str, torch.Tensor],
        grads: tuple[torch.Tensor, tuple[torch.Tensor, ...]],
    ) -> tuple[torch.Tensor | None, dict[str, torch.Tensor]]:
        """``grad_with_extra`` of ``outputs`` (the layer output or its edge, the extra outputs)
        for the input ``x`` (if ``input_grad``) and the trained ``params``: ``(g_x, grads)``."""
        trained = self.trained(params)
        inputs = ((x,) if self.input_grad else ()) + tuple(trained.values())
        assert inputs, "a layer with no gradient to compute is not differentiated"
        got = list(grad_with_extra(outputs[0], outputs[1], inputs, grads[0], grads[1]))
        g_x = got.pop(0) if self.input_grad else None
        return g_x, dict(zip(trained, got, strict=True))

    def module_forward(
        self, params: dict[str, torch.Tensor], x: torch.Tensor, *, eager: bool = False
    ) -> tuple[torch.Tensor, tuple[torch.Tensor, ...]]:
        """The layer's output and its extra outputs (``HFAdapter.run_layer``)."""
        return self.adapter.run_layer(self.layer, params, x, self.ctx, eager=eager or self.eager)

    def shared_ids(self) -> set[int]:
        """ids of the tensors every layer reads (rotary cos/sin, masks, positions)."""
        cos, sin = self.ctx["position_embeddings"][self.layer]
        shared = [cos, sin, self.ctx["position_ids"], self.ctx["masks"][self.layer]]
        return {id(t) for t in shared if isinstance(t, torch.Tensor)}


@dataclass
class LayerState:
    """One layer's saved activations between its forward and its backward."""

    tensors: list[torch.Tensor | None]
    retained_bytes: int = 0
    data: Any = None  # the family's own bookkeeping
    extra: tuple[torch.Tensor, ...] = ()  # the layer's extra outputs (router logits), detached

    def saved_bytes(self) -> list[int]:
        return [0 if t is None else t.numel() * t.element_size() for t in self.tensors]

    def tensor(self, k: int) -> torch.Tensor:
        t = self.tensors[k]
        assert t is not None, "a saved activation is still on the host (reload it first)"
        return t


def leaves(params: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Parameters as autograd leaves (no copy: they share the slot's memory)."""
    return {n: p.detach().requires_grad_(True) for n, p in params.items()}


class InputGrad(torch.autograd.Function):
    """Identity on the layer input that stores the input's gradient in ``box``. The graph then
    ends at a 0-element ``anchor`` leaf instead of the input, so the graph alone never keeps
    the input on the device (an offloaded input really leaves)."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, anchor: torch.Tensor, box: dict[str, Any]) -> Any:
        ctx.box = box
        return x.view_as(x)

    @staticmethod
    def backward(ctx: Any, g: torch.Tensor) -> Any:
        ctx.box["g"] = g
        return None, torch.zeros_like(ctx.box["anchor"]), None


def grad_with_extra(
    out: Any,
    extra: tuple[Any, ...],
    inputs: tuple[torch.Tensor, ...],
    g: torch.Tensor,
    g_extra: tuple[torch.Tensor, ...],
) -> tuple[torch.Tensor, ...]:
    """``torch.autograd.grad`` of the layer output ``out`` (a tensor or its gradient edge) and
    its extra outputs, with their gradients ``g`` and ``g_extra`` (``()``: none flows back)."""
    assert not g_extra or len(g_extra) == len(extra), "a gradient for each extra output"
    outputs = [out, *extra] if g_extra else [out]
    return torch.autograd.grad(outputs, inputs, [g, *g_extra])


@dataclass
class KeptGraph:
    """A layer's autograd graph kept from its forward to its backward (``N``, ``S``, ``SAC``).

    ``start`` makes the input the start of a graph through ``InputGrad`` and the parameters
    leaves; ``close`` keeps the output's (and extra outputs') gradient edges, not their
    memory; ``differentiate`` runs the backward from them and returns the input's gradient
    and the parameters'."""

    box: dict[str, Any]  # InputGrad's: the anchor, then the input's gradient
    leaves: dict[str, torch.Tensor]  # the forward's parameter leaves (the slot it ran on)
    out: GradientEdge | None = None
    extra: tuple[GradientEdge, ...] = ()

    @classmethod
    def start(
        cls, x: torch.Tensor, params: dict[str, torch.Tensor]
    ) -> tuple[KeptGraph, torch.Tensor]:
        anchor = torch.empty(0, device=x.device, dtype=x.dtype, requires_grad=True)
        graph = cls({"anchor": anchor}, leaves(params))
        return graph, InputGrad.apply(x.detach(), anchor, graph.box)

    def close(
        self, out: torch.Tensor, extra: tuple[torch.Tensor, ...] | list[torch.Tensor] = ()
    ) -> tuple[torch.Tensor, tuple[torch.Tensor, ...]]:
        """Keep the edges; the output and extra outputs, detached."""
        self.out = get_gradient_edge(out)
        self.extra = tuple(get_gradient_edge(e) for e in extra)
        return out.detach(), tuple(e.detach() for e in extra)

    def differentiate(
        self, run: LayerRun, g: torch.Tensor, g_extra: tuple[torch.Tensor, ...]
    ) -> tuple[torch.Tensor | None, dict[str, torch.Tensor]]:
        """The backward for ``run``'s gradients (``LayerRun.differentiate``)."""
        assert self.out is not None, "the graph was not closed"
        outputs = (self.out, self.extra)
        _, grads = run.differentiate(outputs, self.box["anchor"], self.leaves, (g, g_extra))
        return self.box.pop("g", None), grads


@dataclass
class ParamAliases:
    """Saved-tensor hooks of a graph kept until the backward (``N``): parameter views become
    (name, size, stride, offset) and are rebuilt on the slot ``params`` points at when the
    backward unpacks them; shared tensors are kept by reference; every other tensor goes into
    ``tensors`` as its base, once (a view saved by several operators costs its storage once,
    and a reloaded base, laid out with the same strides, rebuilds every view of it)."""

    param_ids: dict[int, str]
    shared: set[int]
    tensors: list[torch.Tensor | None] = field(default_factory=list)
    params: dict[str, torch.Tensor] = field(default_factory=dict)  # set for the backward
    _index: dict[int, int] = field(default_factory=dict)
    _keep: list[torch.Tensor] = field(default_factory=list)  # ids stay unique while kept

    def pack(self, t: torch.Tensor) -> tuple[Any, ...]:
        root = t._base if t._base is not None else t  # views are kept as their base, once
        offset = t.storage_offset() - root.storage_offset()
        name = self.param_ids.get(id(root))
        if name is not None:
            return ("param", name, tuple(t.size()), tuple(t.stride()), offset)
        if id(root) in self.shared:
            return ("shared", t)
        k = self._index.get(id(root))
        if k is None:
            k = self._index[id(root)] = len(self.tensors)
            self.tensors.append(root)
            self._keep.append(root)
        if t is root:
            return ("act", k)
        return ("view", k, tuple(t.size()), tuple(t.stride()), offset)

    def unpack(self, token: tuple[Any, ...]) -> torch.Tensor:
        kind = token[0]
        if kind == "shared":
            shared: torch.Tensor = token[1]
            return shared
        if kind == "act":
            t: torch.Tensor | None = self.tensors[token[1]]
            assert t is not None, "a saved activation is still on the host (reload it first)"
            return t
        _, key, size, stride, offset = token
        base = self.params[key] if kind == "param" else self.tensors[key]
        assert base is not None, "a saved activation is still on the host (reload it first)"
        rebuilt: torch.Tensor = base.as_strided(size, stride, base.storage_offset() + offset)
        return rebuilt

    def forget_packed(self) -> None:
        """After the forward: drop the identity keep-alive list (``tensors`` holds them)."""
        self._keep = []
        self._index = {}
