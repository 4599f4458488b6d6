"""The compute-only reference: our step's computation with every weight resident on the device.

Same decoder-layer modules (``HFAdapter``, ``bind_params``), dtype, per-layer activation layout
and executors (offload ratios left out), embedding, chunked loss and layer compute
(``models.fast``) as the engine. Invariant: it leaves out everything that moves data or
updates weights (no window, store, transfers or optimizer: gradients computed and dropped), and
every layer runs, so its step time is the model's compute time.

Example::

    times = run_reference(spec)  # a RunSpec with system="reference"
"""

from __future__ import annotations

from typing import Any

import torch

from slidedp.autopolicy.auto import AUTO
from slidedp.autopolicy.default import FIXED
from slidedp.bench.measure import RunSpec, synthetic_tokens, timed_steps
from slidedp.bench.ours import auto_layout
from slidedp.models.fast import Compute, apply_compute, resolve_compute
from slidedp.models.hf import EMBED, LM_HEAD, NORM, HFAdapter
from slidedp.models.loss import IGNORE_INDEX, shift_labels
from slidedp.plan.device import pick_dtype
from slidedp.plan.layout import LayerPolicy, format_layout, parse_layout
from slidedp.plan.policy import read_policy_file
from slidedp.runtime.activations import LayerRun, LayerState, executor_for


def init_weights(
    adapter: HFAdapter, device: torch.device, dtype: torch.dtype, seed: int
) -> dict[str, torch.Tensor]:
    """Every stored parameter on ``device``: N(0, initializer_range) matrices, unit norms."""
    gen = torch.Generator(device).manual_seed(seed)
    std = float(getattr(adapter.config, "initializer_range", 0.02))
    weights = {}
    for name, shape in adapter.shapes().items():
        t = torch.empty(shape, device=device, dtype=dtype)
        weights[name] = t.normal_(0.0, std, generator=gen) if len(shape) > 1 else t.fill_(1.0)
    return weights


class ReferenceModel:
    """All groups of ``adapter`` resident on ``device``; ``step`` is fwd + bwd of one batch."""

    def __init__(
        self,
        adapter: HFAdapter,
        device: torch.device,
        dtype: torch.dtype,
        chunk_tokens: int,
        layers: tuple[LayerPolicy, ...] | None = None,
        compute: Compute | None = None,
    ) -> None:
        """``layers``: the activation layout (default: every layer ``F``); ``compute``: the
        layer kernels and compilation (default: eager, not compiled)."""
        self.adapter, self.device, self.chunk_tokens = adapter, device, chunk_tokens
        self.weights = init_weights(adapter, device, dtype, seed=0)
        self.rotary = adapter.make_rotary(device)
        self.embed = adapter.make_embed(device)
        layout = layers or (LayerPolicy("F"),) * adapter.num_layers
        self.executors = [executor_for(p) for p in layout]
        self.compute = compute or Compute("eager", "")
        apply_compute(adapter, self.compute)

    def _layer_params(self, layer: int) -> dict[str, torch.Tensor]:
        group = self.adapter.groups[self.adapter.layer_group(layer)]
        return {local: self.weights[full] for full, local in group.params}

    def step(self, input_ids: torch.Tensor) -> tuple[float, torch.Tensor]:
        """Forward + backward of ``input_ids`` [B, S] (labels = inputs): the loss and the
        embedding's gradient (the end of the backward chain; the tied head's added)."""
        a, w = self.adapter, self.weights
        ids = input_ids.to(self.device)
        targets = shift_labels(ids)  # [B, S]
        n_labels = int((targets != IGNORE_INDEX).sum())
        embed_w = w[EMBED]  # [V, H]
        with torch.no_grad():
            x = a.embed(self.embed, ids, embed_w)  # [B, S, H]
            position_ids = torch.arange(x.shape[1], device=self.device).unsqueeze(0)  # [1, S]
            ctx = {
                "position_ids": position_ids,
                "position_embeddings": a.position_embeddings(self.rotary, x, position_ids),
                "masks": a.layer_masks(x, torch.ones_like(ids), position_ids),
            }
        states: list[LayerState] = []
        for layer in range(a.num_layers):  # forward: each layer saves what its family keeps
            run = LayerRun(a, layer, self._layer_params(layer), ctx)
            x, state = self.executors[layer].forward(run, x)
            states.append(state)
        head_w = embed_w if a.tied else w[LM_HEAD]
        loss_sum, g, _, g_head_w = a.head_loss(
            x, w[NORM], head_w, targets, n_labels, self.chunk_tokens
        )
        loss = float(loss_sum) / max(n_labels, 1)
        g_extra: list[tuple[torch.Tensor, ...]] = [()] * a.num_layers
        if a.router_loss is not None:  # the load-balancing term, as the engine adds it
            aux, g_extra = a.router_loss([s.extra for s in states], None)
            loss += a.router_loss.coef * float(aux)
        for layer in reversed(range(a.num_layers)):  # backward: as the family replays
            run = LayerRun(a, layer, self._layer_params(layer), ctx)
            assert g is not None, "nothing is frozen: every gradient is computed"
            g, _ = self.executors[layer].backward(run, states.pop(), g, g_extra[layer])
        assert g is not None, "nothing is frozen"
        g_embed = a.embed_backward(self.embed, ids, embed_w, g, g_head_w)
        return loss, g_embed


def run_reference(spec: RunSpec) -> dict[str, Any]:
    """Timed steps of the reference on ``spec``'s synthetic batches, with our engine's dtype,
    loss chunk, layout and layer compute (from ``spec.ours``, the config ours runs with, and
    its policy file)."""
    device = torch.device(spec.device)
    adapter = HFAdapter.from_dir(spec.config_dir)
    dtype = pick_dtype(spec.ours["train"]["dtype"], device)
    rt = spec.ours["runtime"]
    if rt["policy"] == AUTO:  # the layout ours chose
        rt = rt | {"layers": auto_layout(spec), "policy": ""}
    elif rt["policy"] not in ("", FIXED):  # the policy file's keys replace the runtime's
        rt = rt | read_policy_file(rt["policy"])
    layers = parse_layout(rt["layers"], adapter.num_layers, default_ratio=0.0)
    compute = resolve_compute(rt["kernels"], rt["compile"], device, adapter)
    model = ReferenceModel(adapter, device, dtype, rt["loss_chunk_tokens"], layers, compute)
    tokens = synthetic_tokens(
        adapter.vocab_size, spec.batch, spec.seq_len, spec.warmup + spec.steps, spec.seed
    )
    losses: list[float] = []
    times = timed_steps(
        lambda t: losses.append(model.step(tokens[t])[0]),
        warmup=spec.warmup,
        steps=spec.steps,
        device=device,
    )
    return {
        "step_times_s": times,
        "tokens_per_step": spec.batch * spec.seq_len,
        "losses": losses[spec.warmup :],
        "kernels": compute.describe(),
        "layout": format_layout(layers),
    }
