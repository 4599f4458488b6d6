"""One synchronous training step, streamed layer by layer through the device window.

Step ``t`` (0-based) computes with parameter version ``t`` of every group and publishes
``t + 1``; before group ``g`` is loaded, ``store.wait_version(g, t)`` (per-group gate, never a
global barrier). Order:

1. embed → ``x0``; for each layer ``l``: fetch (version gate, cast, H2D), prefetch ``l + 1``,
   save ``l``'s input (device, or host with ``offload_ratio`` 1), forward without grad;
2. final norm + chunked linear/CE (``models.loss``), gradient of the head to the host store;
3. for ``l`` from last to first: reload params (and the offloaded input), recompute the layer
   with grad, backward, gradient D2H into ``store.group_state(g, "grad")``;
4. embedding backward (plus the tied head's gradient when embeddings are tied).

Clipping (``max_grad_norm > 0``), exact global-norm: every group's gradient goes to the host
``grad`` region during the backward and each parameter's L2 norm is kept on the device; after
the backward ``total = ‖norms‖₂`` and ``clip_coef = min(1, max_norm / (total + 1e-6))`` —
``torch.nn.utils.clip_grad_norm_``'s formula — then every group is submitted in forward order
(embed, layers.0, …, head) with ``grad_scale = clip_coef``, so the next step's forward of layer
``l`` waits only for ``l``'s update. Cost: the update lane cannot start before the backward
ends (no update/backward overlap), and the host holds one gradient per parameter. Without
clipping each group is submitted as soon as its gradient is on the host (the paper's overlap).
A non-finite loss, or a non-finite norm, raises ``NonFiniteError`` before the update of the
offending group is submitted; with clipping, before any update of the step.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F

from slidedp.data.batch import Batch
from slidedp.errors import HostIOError, NonFiniteError
from slidedp.kernels import Kernels
from slidedp.models.hf import EMBED, LM_HEAD, NORM, HFAdapter, bind_params
from slidedp.models.loss import IGNORE_INDEX, chunked_lm_loss, shift_labels
from slidedp.runtime.lanes import LaneClock
from slidedp.runtime.transfer import GradTicket, Transfers
from slidedp.runtime.window import DeviceBuffer, Window
from slidedp.store import HostStore
from slidedp.update import UpdateWorker


@dataclass(frozen=True)
class OptimConfig:
    betas: tuple[float, float]
    eps: float
    weight_decay: float
    max_grad_norm: float  # 0: no clipping


@dataclass(frozen=True)
class StepResult:
    loss: float
    grad_norm: float
    clip_coef: float
    label_tokens: int


class Engine:
    """Runs steps on ``device`` in ``dtype`` over the parameters of ``store``."""

    def __init__(
        self,
        adapter: HFAdapter,
        store: HostStore,
        *,
        device: torch.device,
        dtype: torch.dtype,
        optim: OptimConfig,
        slots: int,
        offload_ratio: float,
        loss_chunk_tokens: int,
        threads: int | None,
        version_timeout_s: float,
    ) -> None:
        self.adapter, self.store, self.device, self.dtype = adapter, store, device, dtype
        self.optim, self.offload = optim, offload_ratio > 0
        self.chunk_tokens, self.timeout_s = loss_chunk_tokens, version_timeout_s
        self.clock = LaneClock(device)
        self.kernels = Kernels(threads)
        self.worker = UpdateWorker(store, threads)
        layers = [adapter.layer_group(i) for i in range(adapter.num_layers)]
        self.window = Window(
            store, self.kernels, device, dtype, layers, slots, self.clock, version_timeout_s
        )
        self.embed_buf = self.window.own_buffer(adapter.embed_group)
        self.head_buf = self.window.own_buffer(adapter.head_group)
        self.transfers = Transfers(store, self.clock, self.window.copy_stream)
        self.rotary = adapter.make_rotary(device)
        self._update_busy_s = 0.0
        if device.type == "cuda":
            self._pin_host_regions()

    def _pin_host_regions(self) -> None:
        cudart = torch.cuda.cudart()  # type: ignore[no-untyped-call]
        for region in ("staging", "grad"):
            t = self.store.region(region)
            if t.numel():
                err = cudart.cudaHostRegister(t.data_ptr(), t.numel() * t.element_size(), 0)
                if int(err) != 0:
                    raise HostIOError(
                        f"cudaHostRegister of the {region} region failed ({err}): check "
                        "`ulimit -l` and free host memory"
                    )

    def _run_layer(
        self, layer: int, params: dict[str, torch.Tensor], x: torch.Tensor, ctx: dict[str, Any]
    ) -> torch.Tensor:
        module = self.adapter.layer_module(layer)
        group = self.adapter.groups[self.adapter.layer_group(layer)]
        bind_params(module, {local: params[full] for full, local in group.params})
        out = module(
            x,
            attention_mask=ctx["masks"][layer],
            position_ids=ctx["position_ids"],
            position_embeddings=ctx["position_embeddings"],
            past_key_values=None,
            use_cache=False,
        )
        result: torch.Tensor = out[0] if isinstance(out, tuple) else out
        return result

    def _fetch(self, group: int, version: int) -> DeviceBuffer:
        buf = self.window.fetch(group, version)
        assert buf is not None, "no free slot: the previous layer was not released"
        self.window.acquire(buf)
        return buf

    def _submit(self, ticket: GradTicket, step: int, lr: float, grad_scale: float) -> None:
        ticket.wait(self.clock)
        self.worker.submit(
            ticket.group,
            step=step + 1,
            lr=lr,
            betas=self.optim.betas,
            eps=self.optim.eps,
            weight_decay=self.optim.weight_decay,
            grad_scale=grad_scale,
            version=step + 1,
        )

    def _settle(self, ticket: GradTicket | None, step: int, lr: float) -> None:
        """Overlap mode: check the group's gradient is finite, then submit its update."""
        if ticket is None or self.optim.max_grad_norm > 0:
            return
        norm = torch.linalg.vector_norm(torch.stack(ticket.norms))
        if not torch.isfinite(norm):
            name = self.adapter.groups[ticket.group].name
            raise NonFiniteError(
                f"step {step}: the gradient of '{name}' is not finite ({float(norm)}); its "
                "update and those of the groups after it in backward order were not applied",
                step=step,
                what="grad_norm",
            )
        self._submit(ticket, step, lr, 1.0)

    def step(self, t: int, batch: Batch, lr: float) -> StepResult:
        """One optimizer step on ``batch`` with learning rate ``lr``; updates are queued."""
        a, win, v = self.adapter, self.window, t
        targets_host = shift_labels(batch.labels)  # [B, S]
        n_labels = int((targets_host != IGNORE_INDEX).sum())
        ids = batch.input_ids.to(self.device, non_blocking=True)  # [B, S]
        targets = targets_host.to(self.device, non_blocking=True)
        attn = batch.attention_mask.to(self.device, non_blocking=True)
        win.load(self.embed_buf, a.embed_group, v)
        win.acquire(self.embed_buf)
        embed_w = win.views(self.embed_buf, a.embed_group)[EMBED]  # [V, H]
        compute = torch.cuda.current_stream() if self.device.type == "cuda" else None
        with self.clock.stream("compute", compute), torch.no_grad():
            x = F.embedding(ids, embed_w, a.padding_idx)  # [B, S, H]
            position_ids = torch.arange(x.shape[1], device=self.device).unsqueeze(0)  # [1, S]
            ctx = {
                "position_ids": position_ids,
                "position_embeddings": self.rotary(x, position_ids),
                "masks": a.layer_masks(x, attn, position_ids),
            }
        saved: list[torch.Tensor | None] = []
        for layer in range(a.num_layers):  # forward, inputs saved (full-layer checkpointing)
            buf = self._fetch(a.layer_group(layer), v)
            if layer + 1 < a.num_layers:
                win.fetch(a.layer_group(layer + 1), v)  # prefetch
            else:
                win.load(self.head_buf, a.head_group, v)
            saved.append(self.transfers.offload(x) if self.offload else x)
            with self.clock.stream("compute", compute), torch.no_grad():
                x = self._run_layer(layer, win.views(buf, a.layer_group(layer)), x, ctx)
            win.release(buf)
        win.acquire(self.head_buf)
        head = win.views(self.head_buf, a.head_group)
        with self.clock.stream("compute", compute):
            x_last = x.detach().requires_grad_(True)
            norm_w = head[NORM].detach().requires_grad_(True)
            bind_params(a.norm_module(), {"weight": norm_w})
            with torch.enable_grad():
                normed = a.norm_module()(x_last)  # [B, S, H]
            head_w = embed_w if a.tied else head[LM_HEAD]
            loss_sum, g_normed, g_head_w = chunked_lm_loss(
                normed.detach(), head_w, targets, n_labels, self.chunk_tokens
            )
            g, g_norm_w = torch.autograd.grad(normed, (x_last, norm_w), g_normed)
        win.release(self.head_buf)
        loss = float(loss_sum) / max(n_labels, 1)
        if not math.isfinite(loss):
            raise NonFiniteError(
                f"step {t}: the loss is not finite ({loss}); no update of this step was applied",
                step=t,
                what="loss",
            )
        head_grads = {NORM: g_norm_w} if a.tied else {NORM: g_norm_w, LM_HEAD: g_head_w}
        pending = self.transfers.grads_to_host(a.head_group, head_grads)
        tickets = [pending]
        for layer in reversed(range(a.num_layers)):  # backward: reload, recompute, grad
            group = a.layer_group(layer)
            buf = self._fetch(group, v)
            if layer > 0:
                win.fetch(a.layer_group(layer - 1), v)
            x_saved = saved[layer]
            assert x_saved is not None
            with self.clock.stream("compute", compute):
                x_in = self.transfers.reload(x_saved, self.device) if self.offload else x_saved
                x_in = x_in.detach().requires_grad_(True)
                views = win.views(buf, group)
                leaves = {n: p.detach().requires_grad_(True) for n, p in views.items()}
                with torch.enable_grad():
                    out = self._run_layer(layer, leaves, x_in, ctx)
                grads = torch.autograd.grad(out, (x_in, *leaves.values()), g)
            win.release(buf)
            saved[layer] = None
            g = grads[0]
            self._settle(pending, t, lr)  # the previous group, once this layer is issued
            pending = self.transfers.grads_to_host(group, dict(zip(leaves, grads[1:], strict=True)))
            tickets.append(pending)
        with self.clock.stream("compute", compute):
            w = embed_w.detach().requires_grad_(True)
            with torch.enable_grad():
                emb = F.embedding(ids, w, a.padding_idx)
            (g_embed,) = torch.autograd.grad(emb, w, g)
            if a.tied:
                g_embed = g_embed + g_head_w
        win.release(self.embed_buf)
        self._settle(pending, t, lr)
        tickets.append(self.transfers.grads_to_host(a.embed_group, {EMBED: g_embed}))
        self._settle(tickets[-1], t, lr)
        return self._finish(t, lr, loss, n_labels, tickets)

    def _finish(
        self, t: int, lr: float, loss: float, n_labels: int, tickets: list[GradTicket]
    ) -> StepResult:
        """Global norm; with clipping, submit every group in forward order scaled by the coef."""
        all_norms = [n for tk in tickets for n in tk.norms]
        total = torch.linalg.vector_norm(torch.stack(all_norms))  # clip_grad_norm_'s total
        grad_norm = float(total)
        coef = 1.0
        if self.optim.max_grad_norm > 0:
            if not torch.isfinite(total):
                raise NonFiniteError(
                    f"step {t}: the gradient norm is not finite ({grad_norm}); "
                    "no update of this step was applied",
                    step=t,
                    what="grad_norm",
                )
            coef_t = torch.clamp(self.optim.max_grad_norm / (total + 1e-6), max=1.0)
            coef = float(coef_t)
            for ticket in sorted(tickets, key=lambda tk: tk.group):
                self._submit(ticket, t, lr, coef)
        return StepResult(loss=loss, grad_norm=grad_norm, clip_coef=coef, label_tokens=n_labels)

    def lane_times(self) -> dict[str, float]:
        """This step's lane times (closes the step's timing window)."""
        _, busy_s = self.worker.stats()
        times = self.clock.summary()
        times["update_s"] = round(busy_s - self._update_busy_s, 6)
        self._update_busy_s = busy_s
        self.clock.reset()
        return times

    def drain(self) -> None:
        self.worker.drain(self.timeout_s)
