"""One synchronous training step, streamed layer by layer through the device window.

Step ``t`` (0-based) computes with parameter version ``t`` of every group and publishes
``t + 1``; before group ``g`` is loaded, ``store.wait_version(g, t)`` (per-group gate, never a
global barrier). Order: embed; each layer's fetch (version gate, cast, H2D), prefetch of the
next and forward under its activation layout; the chunked loss (plus a mixture of experts'
load-balancing loss); each layer's backward from last to first, its gradient handed to the
gradient lane (``grad_lane``, ``grad_sync.GradSync``); the embedding's backward. Frozen
parameters (``models.freeze.Trained``) get no gradient; below the lowest layer whose backward
is needed, layers run forward only. Invariants: with clipping (``max_grad_norm > 0``) the
update is exactly ``torch.nn.utils.clip_grad_norm_`` + AdamW over the global batch of every
rank (the trained parameters); each group's owner alone updates it and publishes its version; a
non-finite loss or norm raises ``NonFiniteError`` before any update of the step (``skip(t)``
advances the versions). The full schedule: docs/architecture.md, "One step's data path".
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass, field
from typing import Any

import torch

from slidedp.data.batch import Batch
from slidedp.errors import NonFiniteError
from slidedp.kernels import Kernels
from slidedp.models.fast import apply_compute
from slidedp.models.freeze import Trained
from slidedp.models.hf import EMBED, LM_HEAD, NORM, HFAdapter
from slidedp.models.loss import IGNORE_INDEX, shift_labels
from slidedp.plan.policy import Plan
from slidedp.runtime.activations import LayerRun, LayerState, executor_for
from slidedp.runtime.activations.offload import ActivationOffload, offload_count
from slidedp.runtime.context_parallel import bind_attention, full_sequence_masks, pad_width
from slidedp.runtime.dist import Dist, all_reduce_sum, all_reduce_tensor
from slidedp.runtime.grad_lane import GradLane, RankShare
from slidedp.runtime.grad_sync import GradSync
from slidedp.runtime.lanes import LaneClock, new_stream
from slidedp.runtime.pinning import pin_dma_memory
from slidedp.runtime.resident import Owners, ResidentLayers
from slidedp.runtime.routes import GpuReduce, HostSum
from slidedp.runtime.trace import StepTrace
from slidedp.runtime.transfer import unpin
from slidedp.runtime.window import DeviceBuffer, Shard, Window, WindowSpec
from slidedp.store import HostStore
from slidedp.update import HostSumRing, UpdateWorker


def layer_state(states: list[LayerState | None], layer: int) -> LayerState:
    """Layer ``layer``'s saved activations (between its forward and its backward)."""
    state = states[layer]
    assert state is not None, f"layer {layer}'s activations were already released"
    return state


@dataclass(frozen=True)
class StepResult:
    loss: float  # the mean token loss, plus router_aux_loss_coef * aux_loss for an MoE
    grad_norm: float
    clip_coef: float
    label_tokens: int
    aux_loss: float | None = None  # the load-balancing loss alone (MoE with router logits)


@dataclass
class _Inputs:
    """A step's batch on the device and what every layer reads (positions, rotary, masks)."""

    ids: torch.Tensor  # [B, S]
    targets: torch.Tensor  # [B, S] shifted labels
    attn: torch.Tensor | None  # [B, S] padding mask (a context shard's [B, S/R]); None: packed
    n_labels: int  # label tokens of the global batch
    compute: torch.cuda.Stream | None
    ctx: dict[str, Any] = field(default_factory=dict)


@dataclass(frozen=True)
class _Update:
    """What each group's update of the step needs besides its gradient."""

    t: int
    adam_step: int
    lr: float


class Engine:
    """Runs steps of ``plan`` (device, dtype, ``Policy``, optimizer) over the parameters of
    ``store``."""

    def __init__(
        self,
        adapter: HFAdapter,
        store: HostStore,
        plan: Plan,
        *,
        ctx: Dist | None = None,
        signals: HostStore | None = None,
    ) -> None:
        """With ``ctx``, the store holds ``ctx.local_world`` times the slots of one rank; the cpu
        gradient route needs ``signals`` (``routes.share_signals``)."""
        device, policy = plan.device, plan.policy
        self.adapter, self.store, self.device, self.dtype = adapter, store, device, plan.dtype
        self.plan, self.optim = plan, plan.optim
        self.chunk_tokens, self.timeout_s = plan.loss_chunk_tokens, plan.version_timeout_s
        self.ctx = ctx
        if len(policy.layers) != adapter.num_layers:
            raise ValueError(
                f"the policy has {len(policy.layers)} layers, the model {adapter.num_layers}"
            )
        self.executors = [executor_for(p) for p in policy.layers]
        self.trained = Trained.of(adapter)
        apply_compute(adapter, policy.compute)
        rank, world = (0, 1) if ctx is None else (ctx.local_rank, ctx.local_world)
        self.grad_slots = store.layout.grad_slots // world  # this rank's share of each ring
        self.clock = LaneClock(device)
        self.kernels = Kernels(plan.threads)
        self.grads, self.worker, self.reduce = self._grad_lane(signals, rank, world)
        self._target = 0  # the version every group reaches once this rank's updates are done
        self.window = self._window(rank, world)
        self.pinned: list[torch.Tensor] = []  # bytes of the store this rank page-locked
        started = time.perf_counter()
        if device.type == "cuda":
            grad = (rank * self.grad_slots, self.grad_slots)
            self.pinned = pin_dma_memory(store, self.window, self.grads.landing, grad)
        self.pin_s = time.perf_counter() - started  # page-locking the store's slots (startup),
        # before the resident groups' weights are copied from the mirror
        self.resident = None
        self.resident_s = 0.0  # the resident groups' state allocated and loaded (startup)
        layers = [adapter.layer_group(i) for i in range(adapter.num_layers)]
        groups = [g for i, g in enumerate(layers) if policy.resident(i)]
        if policy.resident_embeddings:
            groups += [adapter.embed_group, adapter.head_group]
        if groups:
            assert self.reduce is not None or ctx is None, "refused by dist.check_config"
            owners = None
            if ctx is not None and ctx.local_world > 1:  # each owns its groups' state
                owners = Owners(ctx, ctx.new_node_group(plan.version_timeout_s))
            started = time.perf_counter()
            self.resident = ResidentLayers(store, self.window, self.kernels, self.worker,
                                           groups, device, owners)  # fmt: skip
            self.resident_s = time.perf_counter() - started
        self.sync = GradSync(self.grads, self.reduce, self.optim, ctx, device, self.resident)
        self.worker.prefault(self.sync.host_update_order(store.layout))  # faulted in ahead
        self.embed_buf = self._own_buffer(adapter.embed_group)
        self.head_buf = self._own_buffer(adapter.head_group)
        self.activations = ActivationOffload(device, self.clock)
        self.rotary = adapter.make_rotary(device)
        self.context = None if ctx is None else ctx.context  # runtime.context_parallel > 1
        if self.context is not None:
            bind_attention(adapter.config, self.context)
        self.embed = adapter.make_embed(device)
        self._update_busy_s = 0.0

    def _grad_lane(
        self, signals: HostStore | None, rank: int, world: int
    ) -> tuple[GradLane, UpdateWorker, GpuReduce | None]:
        """The gradient lane of this rank, its update worker and the gpu route's reduce."""
        ctx, plan, device = self.ctx, self.plan, self.device
        route = plan.policy.grad_route
        ring = None
        if ctx is not None and route == "cpu":
            assert signals is not None, "the cpu gradient route needs the signal store"
            ring = HostSumRing(signals, rank, world, self.grad_slots, plan.version_timeout_s)
        worker = UpdateWorker(self.store, plan.threads, ring)
        reduce = GpuReduce(ctx, self.clock) if ctx is not None and route == "gpu" else None
        host_sum = None
        if ctx is not None and ring is not None:
            host_sum = HostSum(ctx, self.store, worker, self.kernels, self.clock, ring.signals)
        share = RankShare(rank * self.grad_slots, self.grad_slots, host_sum,
                          (lambda g: True) if ctx is None else ctx.owns)  # fmt: skip
        stream = new_stream(device) if device.type == "cuda" else None
        names = self.adapter.groups
        lane = GradLane(self.store, worker, self.clock, stream, plan.version_timeout_s,
                        lambda g: names[g].name, share)  # fmt: skip
        return lane, worker, reduce

    def _window(self, rank: int, world: int) -> Window:
        """The device window of the streamed layers (this rank's share of the staging slots)."""
        a, plan, ctx = self.adapter, self.plan, self.ctx
        staging = self.store.layout.staging_slots // world
        layers = [a.layer_group(i) for i in range(a.num_layers)]
        sharded = ctx is not None and plan.policy.param_route == "sharded"
        spec = WindowSpec(
            plan.dtype,
            layers,
            plan.policy.slots if plan.policy.resident_layers < a.num_layers else 0,  # all resident
            plan.version_timeout_s,
            staging_base=rank * staging,
            staging_count=staging,
            shard=Shard(rank, world, None if ctx is None else ctx.node_group) if sharded else None,
        )
        return Window(
            self.store,
            self.kernels,
            self.device,
            self.clock,
            spec,
            before_wait=lambda group: self.sync.send_ready(group),  # the sync comes next
        )

    def close(self) -> None:
        """Unregister the page-locked host memory (the store's slots, the offload arena): a
        later store may be mapped at the same addresses, and CUDA refuses to register a range
        twice. Idempotent; the engine must not step afterwards."""
        if self.pinned:
            torch.cuda.synchronize(self.device)
            for t in self.pinned:
                unpin(t)
            self.pinned = []
        self.activations.close()

    def _local(self, layer: int, buf: DeviceBuffer) -> dict[str, torch.Tensor]:
        """Layer ``layer``'s parameters in ``buf``, by their names inside the layer module."""
        group = self.adapter.layer_group(layer)
        views = self.window.views(buf, group)
        return {local: views[full] for full, local in self.adapter.groups[group].params}

    def _own_buffer(self, group: int) -> DeviceBuffer:
        """The embedding's or the head's weights: resident, else loaded each step."""
        if self.resident is not None and self.resident.holds(group):
            return self.resident.buffer(group)
        return self.window.own_buffer(group)

    def _load_own(self, buf: DeviceBuffer, group: int, version: int) -> None:
        """Issue the load of the embedding or head at ``version`` (resident: the compute stream
        waits for its update instead)."""
        if self.resident is not None and self.resident.holds(group):
            self.resident.ready(group)
        else:
            self.window.load(buf, group, version)

    def _layer_buffer(self, layer: int, version: int) -> DeviceBuffer:
        """Layer ``layer``'s weights on the device: its resident buffer, or a window slot."""
        group = self.adapter.layer_group(layer)
        if self.resident is not None and self.resident.holds(group):
            return self.resident.buffer(group)
        return self._fetch(group, version)

    def _prefetch(self, layer: int, version: int) -> None:
        """Start loading ``layer`` into the window, unless it is resident (or past the last:
        every layer resident)."""
        if layer < self.adapter.num_layers and not self.plan.policy.resident(layer):
            self.window.fetch(self.adapter.layer_group(layer), version)

    def _fetch(self, group: int, version: int) -> DeviceBuffer:
        buf = self.window.fetch(group, version)
        assert buf is not None, "no free slot: the previous layer was not released"
        self.window.acquire(buf)
        return buf

    def _run(self, layer: int, buf: DeviceBuffer, ctx: dict[str, Any]) -> LayerRun:
        """Layer ``layer`` on the weights in ``buf``, with its frozen parameters."""
        tr = self.trained
        return LayerRun(self.adapter, layer, self._local(layer, buf), ctx,
                        frozen=tr.layer_frozen[layer], input_grad=tr.input_grad[layer])  # fmt: skip

    def _hand_over(self, group: int, grads: dict[str, torch.Tensor], u: _Update) -> None:
        """Group ``group``'s gradients of step ``u.t`` to the sync; a group without any (all
        frozen) only advances its version."""
        if grads:
            self.sync.hand_over(GradLane.ticket(group, grads), u.t, u.adam_step, u.lr)
        else:
            self.grads.publish_frozen(group, u.t + 1)

    def step(self, t: int, batch: Batch, lr: float, adam_step: int | None = None) -> StepResult:
        """One optimizer step on ``batch`` with learning rate ``lr``; updates are queued.
        ``adam_step`` is AdamW's 1-based step count (default ``t + 1``; lower after skips)."""
        a, u = self.adapter, _Update(t, t + 1 if adam_step is None else adam_step, lr)
        inputs = self._inputs(batch)
        self.sync.begin_step()
        self.activations.discard()
        x, embed_w = self._embed_forward(inputs, t)
        x, states = self._forward(x, inputs, t)
        loss_sum, g, head_grads, g_head_w = self._head(x, inputs, embed_w, t)
        total_loss = float(loss_sum)
        if self.ctx is not None:
            total_loss = all_reduce_sum([total_loss], self.device)[0]
        loss = total_loss / max(inputs.n_labels, 1)
        aux_loss = None
        g_extra: list[tuple[torch.Tensor, ...]] = [()] * a.num_layers
        if a.router_loss is not None:
            with self.clock.stream("compute", inputs.compute):
                logits = [layer_state(states, i).extra for i in range(a.num_layers)]
                if self.ctx is None or self.ctx.world == 1:  # transformers' function itself
                    aux, g_extra = a.router_loss(logits, inputs.attn)
                else:  # the global batch's: its token statistics summed over every rank
                    aux, g_extra = a.router_loss.over_ranks(logits, inputs.attn, all_reduce_tensor)
            aux_loss = float(aux)
            loss += a.router_loss.coef * aux_loss
        if not math.isfinite(loss):
            raise NonFiniteError(
                f"step {t}: the loss is not finite ({loss}); no update of this step was applied",
                step=t,
                what="loss",
            )
        self._hand_over(a.head_group, head_grads, u)
        g = self._backward(g, g_extra, states, inputs, u)
        g_embed: dict[str, torch.Tensor] = {}
        if self.trained.embed:
            assert g is not None, "the embedding trains: layer 0's input gradient was computed"
            with self.clock.stream("compute", inputs.compute):
                g_embed[EMBED] = a.embed_backward(self.embed, inputs.ids, embed_w, g, g_head_w)
        self.window.release(self.embed_buf)
        self._hand_over(a.embed_group, g_embed, u)
        self.sync.end_backward()
        self._target = t + 1
        grad_norm, coef = self.sync.finish(t)
        return StepResult(loss=loss, grad_norm=grad_norm, clip_coef=coef,
                          label_tokens=inputs.n_labels, aux_loss=aux_loss)  # fmt: skip

    def _inputs(self, batch: Batch, *, global_labels: bool = True) -> _Inputs:
        """This rank's rows of ``batch`` on the device (its shard of them under context
        parallelism), the global batch's label count (``global_labels=False``: this rank's)."""
        if self.ctx is not None:
            batch = self.ctx.rows(batch)
        if self.context is not None:
            batch = pad_width(batch, self.context.size)
        targets_host = shift_labels(batch.labels)  # [B, S]: shifted before the rows are split
        ids_host = batch.input_ids  # [B, S]
        if self.context is not None:  # this rank's tokens of every row: [B, S/R]
            ids_host, targets_host = self.context.shard(ids_host), self.context.shard(targets_host)
        n_labels = int((targets_host != IGNORE_INDEX).sum())
        if self.ctx is not None and global_labels:  # the mean is over the global batch's
            n_labels = int(all_reduce_sum([n_labels], self.device)[0])
        ids = ids_host.to(self.device, non_blocking=True)  # [B, S]
        targets = targets_host.to(self.device, non_blocking=True)
        # Packed rows: per-sample positions and no padding mask, so transformers' mask builders
        # keep attention inside each sample (see slidedp.data.batch); else a padding mask.
        attn = None
        if batch.position_ids is None:
            attn = batch.attention_mask.to(self.device, non_blocking=True)
        compute = torch.cuda.current_stream() if self.device.type == "cuda" else None
        inputs = _Inputs(ids, targets, attn, n_labels, compute)
        if batch.position_ids is not None:
            inputs.ctx["position_ids"] = batch.position_ids.to(self.device)  # [B, S]
        if self.context is not None:  # the shard's mask and positions, the whole rows' too
            inputs.attn, shared = self.context.layer_inputs(batch, self.device)
            inputs.ctx.update(shared)
        return inputs

    def _embed_forward(self, inputs: _Inputs, v: int) -> tuple[torch.Tensor, torch.Tensor]:
        """The embedding of the batch at version ``v`` and every layer's shared inputs
        (``inputs.ctx``): ``(x [B, S, H], the embedding weight [V, H])``."""
        a = self.adapter
        self._load_own(self.embed_buf, a.embed_group, v)
        self.window.acquire(self.embed_buf)
        embed_w = self.window.views(self.embed_buf, a.embed_group)[EMBED]  # [V, H]
        with self.clock.stream("compute", inputs.compute), torch.no_grad():
            x = a.embed(self.embed, inputs.ids, embed_w)  # [B, S, H]
            position_ids = inputs.ctx.get("position_ids")
            if position_ids is None:
                position_ids = torch.arange(x.shape[1], device=self.device).unsqueeze(0)  # [1, S]
            inputs.ctx.update(
                position_ids=position_ids,
                position_embeddings=a.position_embeddings(self.rotary, x, position_ids),
                masks=a.layer_masks(x, inputs.attn, position_ids)
                if self.context is None  # else every layer attends over the whole rows
                else full_sequence_masks(a.layer_masks, x, inputs.ctx),
            )
        return x, embed_w

    def _forward(
        self, x: torch.Tensor, inputs: _Inputs, v: int
    ) -> tuple[torch.Tensor, list[LayerState | None]]:
        """Every layer's forward; each saves what its family keeps, but a layer below the
        lowest whose backward runs keeps nothing (its extra outputs only)."""
        a = self.adapter
        states: list[LayerState | None] = []
        streamed = self.plan.policy.resident_layers  # the first layer the window loads
        for layer in range(a.num_layers):
            buf = self._layer_buffer(layer, v)
            if layer + 1 < a.num_layers:
                self._prefetch(max(layer + 1, streamed), v)  # a no-op once it is loaded
            else:
                self._load_own(self.head_buf, a.head_group, v)
            run = self._run(layer, buf, inputs.ctx)
            with self.clock.stream("compute", inputs.compute):
                if layer < self.trained.lowest:
                    with torch.no_grad():
                        x, extra = run.module_forward(run.params, x)
                    state = LayerState([], extra=extra)
                else:
                    x, state = self.executors[layer].forward(run, x)
            self.window.release(buf)
            ratio = self.executors[layer].policy.ratio
            self.activations.offload(layer, state, offload_count(state.saved_bytes(), ratio))
            states.append(state)
        return x, states

    def _head(
        self, x: torch.Tensor, inputs: _Inputs, embed_w: torch.Tensor, v: int
    ) -> tuple[torch.Tensor, torch.Tensor | None, dict[str, torch.Tensor], torch.Tensor | None]:
        """The loss and its backward through the final norm and the head: ``(loss sum, d/dx,
        the head group's trained gradients, d/d head weight)``."""
        a, tr = self.adapter, self.trained
        # the backward's first offloaded tensors come back during the head's loss
        self.activations.prefetch(a.num_layers - 1)
        self.window.acquire(self.head_buf)
        head = self.window.views(self.head_buf, a.head_group)
        with self.clock.stream("compute", inputs.compute):
            head_w = embed_w if a.tied else head[LM_HEAD]
            needs = (tr.lowest < a.num_layers, tr.norm, tr.head)
            loss_sum, g, g_norm_w, g_head_w = a.head_loss(
                x, head[NORM], head_w, inputs.targets, inputs.n_labels, self.chunk_tokens, needs
            )
        self.window.release(self.head_buf)
        grads = {NORM: g_norm_w, LM_HEAD: None if a.tied else g_head_w}
        return loss_sum, g, {n: gr for n, gr in grads.items() if gr is not None}, g_head_w

    def _backward(
        self,
        g: torch.Tensor | None,
        g_extra: list[tuple[torch.Tensor, ...]],
        states: list[LayerState | None],
        inputs: _Inputs,
        u: _Update,
    ) -> torch.Tensor | None:
        """Each layer's backward from the last to the lowest that runs (reload, recompute,
        differentiate), its trained gradients handed over; the frozen groups below only
        advance their versions. Returns layer 0's input gradient (None: not computed)."""
        a, v = self.adapter, u.t
        for layer in reversed(range(a.num_layers)):
            group = a.layer_group(layer)
            if layer < self.trained.lowest:
                states[layer] = None
                self._hand_over(group, {}, u)
                continue
            assert g is not None, "a layer's backward runs: the one above gave its gradient"
            buf = self._layer_buffer(layer, v)
            if layer > self.trained.lowest:
                self._prefetch(layer - 1, v)
            run = self._run(layer, buf, inputs.ctx)
            state = layer_state(states, layer)
            with self.clock.stream("compute", inputs.compute):
                self.activations.reload(layer, state)
                if layer > 0:  # the next layer's offloaded tensors copy during this one
                    self.activations.prefetch(layer - 1)
                g, local_grads = self.executors[layer].backward(run, state, g, g_extra[layer])
            self.window.release(buf)
            states[layer] = None
            full = {local: full for full, local in a.groups[group].params}
            self._hand_over(group, {full[n]: gr for n, gr in local_grads.items()}, u)
        return g

    def lane_times(self) -> dict[str, float]:
        """This step's lane times (closes the step's timing window)."""
        _, busy_s = self.worker.stats()
        times = self.clock.summary()
        times["update_s"] = round(busy_s - self._update_busy_s, 6)
        self._update_busy_s = busy_s
        self.clock.reset()
        return times

    def start_trace(self) -> None:
        """Record the next step's lanes as spans (``stop_trace`` after ``lane_times``)."""
        self.worker.take_spans()  # drop older update spans
        self.clock.start_trace()

    def stop_trace(self, step: int) -> StepTrace:
        """The traced step's spans, with its update-lane requests (waited for: the last ones
        may still run when the step returns)."""
        spans = self.clock.stop_trace()
        self.worker.drain(self.timeout_s)
        names = self.adapter.groups
        start = min((s for _, s, _ in spans), default=0.0)
        updates = [(names[g].name, s, e) for g, s, e in self.worker.take_spans() if e > start]
        return StepTrace(step, spans, updates)

    def skip(self, t: int) -> None:
        """Step ``t`` failed before any update: advance every group to version ``t + 1``."""
        self.sync.discard()
        for group in range(self.store.num_groups):
            self.grads.publish_only(group, t + 1)  # owned groups only
        self._target = t + 1

    def start_at(self, t: int) -> None:
        """Resume: the store holds the state after ``t`` steps; the next step is ``t``."""
        self._drain_updates()
        for group in range(self.store.num_groups):
            self.store.publish(group, t)
        self._target = t
        if self.resident is not None:
            self.resident.load()

    def drain(self) -> None:
        """Send every parked gradient and wait for every queued update; then the store holds
        the whole state (the resident layers' written back)."""
        self._drain_updates()
        if self.resident is not None:
            self.resident.write_back()

    def _drain_updates(self) -> None:
        self.sync.send_all(self.store.num_groups)
        self.worker.drain(self.timeout_s)
        if self.ctx is not None:  # the other owners' updates too
            for group in range(self.store.num_groups):
                self.store.wait_version(group, self._target, self.timeout_s)
