"""Sequence-tiled MLP (``runtime.mlp_tile_tokens``): a decoder layer's dense MLP runs tile by
tile along its tokens, so that only one tile's intermediates (gate, up, their product and
their gradients) live at once, whatever the sequence length.

``TiledMLP``'s forward runs the MLP on each tile of ``tile`` tokens (the input flattened to
its tokens) without grad and saves only its input; its backward recomputes each tile's
forward with grad and differentiates it. The weight gradients, summed over the tiles in
float32 at least and rounded once to the weights' dtype, are the Function's own gradients:
they reach ``torch.autograd.grad`` of the layer's parameters (the activation executors)
exactly once, as any operator's. The weights are saved with ``save_for_backward``, so an
executor rebuilds them from the backward's slot (``ParamAliases``, checkpoint replays).
Invariants: an input of at most ``tile`` tokens runs the MLP untiled (bit for bit);
``use_tiled_mlps`` patches a module once (again: the tile changes, nothing is nested).
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import TYPE_CHECKING, Any, cast

import torch
from torch import nn

from slidedp.errors import ConfigError
from slidedp.models.bind import bind_params

if TYPE_CHECKING:
    from slidedp.models.hf import HFAdapter

MlpForward = Callable[[torch.Tensor], torch.Tensor]
_UNTILED = "_slidedp_untiled"  # the wrapper's attribute: (the forward it replaced, tile)


class _Tiling(threading.local):
    forward = False  # inside a tiled forward (selective checkpointing keeps nothing of it)


TILING = _Tiling()


class TiledMLP(torch.autograd.Function):
    @staticmethod
    def forward(
        ctx: Any, mlp: nn.Module, run: MlpForward, tile: int, x: torch.Tensor, *weights: Any
    ) -> torch.Tensor:
        ctx.mlp, ctx.run, ctx.tile = mlp, run, tile
        ctx.names = [n for n, _ in mlp.named_parameters()]
        ctx.save_for_backward(x, *weights)
        flat = x.reshape(-1, x.shape[-1])
        out = torch.empty_like(flat)
        TILING.forward = True
        try:
            for start in range(0, flat.shape[0], tile):
                out[start : start + tile] = run(flat[start : start + tile])
        finally:
            TILING.forward = False
        return out.view_as(x)

    @staticmethod
    def backward(ctx: Any, g: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        x, *weights = ctx.saved_tensors
        need_x, need_w = ctx.needs_input_grad[3], ctx.needs_input_grad[4:]
        leaves = [w.detach().requires_grad_(n) for w, n in zip(weights, need_w, strict=True)]
        trained = [w for w in leaves if w.requires_grad]
        sums = [torch.zeros_like(w, dtype=torch.promote_types(w.dtype, torch.float32))
                for w in trained]  # fmt: skip
        flat, flat_g = x.detach().reshape(-1, x.shape[-1]), g.reshape(-1, g.shape[-1])
        g_x = torch.empty_like(flat) if need_x else None
        before: dict[str, torch.Tensor] = dict(ctx.mlp.named_parameters())
        bind_params(ctx.mlp, dict(zip(ctx.names, leaves, strict=True)))
        try:
            for start in range(0, flat.shape[0], ctx.tile):
                x_tile = flat[start : start + ctx.tile].requires_grad_(need_x)
                with torch.enable_grad():
                    y = ctx.run(x_tile)
                inputs = ([x_tile] if need_x else []) + trained
                got = list(torch.autograd.grad(y, inputs, flat_g[start : start + ctx.tile]))
                if g_x is not None:
                    g_x[start : start + ctx.tile] = got.pop(0)
                for total, part in zip(sums, got, strict=True):
                    total.add_(part)
        finally:
            bind_params(ctx.mlp, before)
        grads = iter(s.to(w.dtype) for s, w in zip(sums, trained, strict=True))
        g_w = [next(grads) if n else None for n in need_w]
        return None, None, None, None if g_x is None else g_x.view_as(x), *g_w


def tiled_forward(mlp: nn.Module, below: MlpForward | None, tile: int) -> MlpForward:
    """``mlp``'s forward tiled by ``tile`` tokens: ``below``, the instance's forward it
    replaces (Liger's), else the class's. Dynamo does not trace it (a compiled layer runs the
    tiles eagerly between its graphs)."""
    run = below if below is not None else _class_forward(mlp)

    def forward(x: torch.Tensor) -> torch.Tensor:
        if x.numel() <= tile * x.shape[-1]:
            return run(x)
        weights = [p for _, p in mlp.named_parameters()]
        return cast(torch.Tensor, TiledMLP.apply(mlp, run, tile, x, *weights))

    eager = cast(MlpForward, torch.compiler.disable(forward))  # type: ignore[no-untyped-call]
    setattr(eager, _UNTILED, (below, tile))
    return eager


def mlp_tile(mlp: nn.Module) -> int:
    """The tile ``mlp`` runs by (0: untiled)."""
    return _patched(mlp)[1]


def tiles(mlp: nn.Module, x: torch.Tensor) -> bool:
    """Whether ``mlp`` runs the input ``x`` by tiles (tiled, and longer than one tile)."""
    tile = mlp_tile(mlp)
    return bool(tile) and x.numel() > tile * x.shape[-1]


def _patched(mlp: nn.Module) -> tuple[MlpForward | None, int]:
    """``mlp``'s instance forward under any tiling (None: the class's) and the tile."""
    forward = mlp.__dict__.get("forward")
    return cast(tuple[MlpForward | None, int], getattr(forward, _UNTILED, (forward, 0)))


def _class_forward(mlp: nn.Module) -> MlpForward:
    return cast(MlpForward, type(mlp).forward.__get__(mlp))


def untiled_forward(mlp: nn.Module) -> MlpForward:
    """``mlp``'s forward under any tiling (Liger's or the class's): what one tile runs."""
    below, _ = _patched(mlp)
    return below if below is not None else _class_forward(mlp)


def tile_layer_mlp(mlp: nn.Module, tile: int) -> None:
    """Run ``mlp`` (its forward as patched so far: Liger's or the class's) tiled by ``tile``
    tokens; 0: untiled again."""
    below, _ = _patched(mlp)
    if tile:
        mlp.forward = tiled_forward(mlp, below, tile)
    elif below is None:
        mlp.__dict__.pop("forward", None)
    else:
        mlp.forward = below


def check_tiling(adapter: HFAdapter, tile: int) -> None:
    """``runtime.mlp_tile_tokens`` on ``adapter``'s model: dense MLPs only."""
    if tile and adapter.moe:
        raise ConfigError(
            f"runtime.mlp_tile_tokens={tile} tiles dense MLPs, and "
            f"{adapter.config.model_type} has mixture-of-experts layers; set "
            "runtime.mlp_tile_tokens=0"
        )


def use_tiled_mlps(adapter: HFAdapter, tile: int) -> None:
    """Every decoder layer's MLP of ``adapter`` tiled by ``tile`` tokens (``check_tiling``)."""
    check_tiling(adapter, tile)
    for layer in range(adapter.num_layers):
        tile_layer_mlp(cast(nn.Module, adapter.layer_module(layer).mlp), tile)


@contextmanager
def tiled_mlp(adapter: HFAdapter, layer: int, tile: int) -> Iterator[None]:
    """While this lasts, decoder layer ``layer``'s MLP runs tiled by ``tile`` (0: as it is):
    the cost model's runs on the meta device."""
    mlp: Any = adapter.layer_module(layer).mlp
    before = mlp.__dict__.get("forward")
    if tile:
        tile_layer_mlp(mlp, tile)
    try:
        yield
    finally:
        if before is None:
            mlp.__dict__.pop("forward", None)
        else:
            mlp.forward = before
