"""GPU-resident decoder layers (``Policy.resident_layers``): the first K layers keep their weights,
FP32 master and Adam moments on the device and are updated there (no H2D, D2H or host AdamW).

The backward hands each resident group's gradient here (``GradSync.hand_over``; its norms join
the global norm once); ``update`` runs at the end of the backward on a stream of its own, with
the clip coefficient as a device tensor and gated on the norm being finite, so it never waits on
the host. CUDA: one compiled elementwise pass per tensor (``adamw_single_pass``), rounding like
torch's fused AdamW; CPU (tests): the engine's host AdamW kernel, bit for bit the all-host run.
Several ranks (gpu gradient route): a group's FP32 master and moments live on its owner
(``Dist.owner``, as a streamed group's update) alone, so each rank holds about 1/R of the state;
every rank keeps the full weights. The gradient is reduced onto the owner (``routes.GpuReduce``,
the streamed groups' collective), whose norms join the clip norm exactly as a streamed group's;
after the update the owner broadcasts the new weights to the node's ranks. Ownership is per
group, not a flat 1/R of each: a parameter split across ranks would split its norm too, and the
clip norm would no longer be the all-host run's bit for bit.
Invariant: the host store stays authoritative (``write_back`` before checkpoints and exports:
each owner writes its groups into the node's one store; ``load`` at start and resume); versions
advance through the update worker's queue.

Example::

    resident = ResidentLayers(store, window, kernels, worker, groups=[1, 2], device=device)
"""

from __future__ import annotations

import functools
import math
from collections.abc import Callable
from dataclasses import dataclass, replace

import torch
import torch.distributed as dist
import torch.fx.experimental._config as fx_config

from slidedp.errors import NonFiniteError
from slidedp.kernels import Kernels
from slidedp.runtime.dist import Dist, collective
from slidedp.runtime.grad_lane import AdamArgs, GradTicket
from slidedp.runtime.lanes import new_event, new_stream
from slidedp.runtime.window import DeviceBuffer, Window
from slidedp.store import HostStore, StateRegion
from slidedp.store_layout import StoreLayout
from slidedp.update import UpdateWorker

REGIONS: tuple[StateRegion, ...] = ("master", "exp_avg", "exp_avg_sq")


@dataclass(frozen=True)
class Owners:
    """Several ranks of a node: ``ctx`` says who owns each resident group; the owners
    broadcast the weights in ``group`` (the node's ranks, ``Dist.new_node_group``), so that
    the next step's collectives in the default group do not wait for the updates."""

    ctx: Dist
    group: dist.ProcessGroup


@dataclass(frozen=True)
class _Param:
    name: str
    state_at: int  # offset in the group's state layout
    slot_at: int  # offset in the group's slot layout (the weights buffer)
    numel: int
    decays: bool  # weight decay applies (tensors of two or more dimensions, as the host)
    frozen: bool = False  # never updated: master weights only (the trained ones come first)


@dataclass
class _Group:
    group: int
    params: list[_Param]
    # region -> f32 on the device: [state_len] master, [trained_len] moments (empty: another
    # rank owns the group)
    state: dict[StateRegion, torch.Tensor]
    weights: DeviceBuffer  # the compute-dtype weights, slot layout

    @property
    def trained(self) -> list[_Param]:
        return [p for p in self.params if not p.frozen]

    def view(self, region: StateRegion, p: _Param) -> torch.Tensor:
        return self.state[region][p.state_at : p.state_at + p.numel]


def group_params(layout: StoreLayout, group: int) -> list[_Param]:
    """``group``'s parameters in a store layout (``HostStore.plan`` or ``store.layout``): their
    offsets in the group's state and slot layouts."""
    spec = layout.groups[group]
    return [
        _Param(p.name, p.state_offset - spec.state_offset, p.slot_offset, p.numel,
               len(p.shape) >= 2, bool(p.frozen))
        for p in layout.params[spec.params.start : spec.params.end]
    ]  # fmt: skip


class ResidentLayers:
    """The resident groups' device state, their pending gradients and their update."""

    def __init__(
        self,
        store: HostStore,
        window: Window,
        kernels: Kernels,
        worker: UpdateWorker,
        groups: list[int],
        device: torch.device,
        owners: Owners | None = None,
    ) -> None:
        """``owners``: several ranks (each owns its groups' state), None: one process."""
        self.store, self.kernels, self.worker, self.device = store, kernels, worker, device
        self.owners = owners
        layout = store.layout
        self._groups: dict[int, _Group] = {}
        for g in sorted(groups):  # forward order: every rank shares the weights in it
            params = group_params(layout, g)
            spec = layout.groups[g]
            lengths = {r: spec.state_len if r == "master" else spec.trained_len for r in REGIONS}
            owned = self.owns(g)
            state = {r: torch.zeros(n, device=device) for r, n in lengths.items() if owned}
            weights = window.own_buffer(g)
            weights.group = g
            self._groups[g] = _Group(g, params, state, weights)
        self._pending: list[tuple[GradTicket, AdamArgs]] = []
        self._issued: list[tuple[int, int]] = []  # (group, version) updated, not yet published
        self._norms = torch.zeros(0)  # the issued gradients' norms without clipping, forward order
        self._stream = new_stream(device) if device.type == "cuda" else None
        self._updated: dict[int, torch.cuda.Event] = {}  # group -> its update's end, not waited
        self._dirty = False  # updated since the last load or write-back (alike on every rank)
        # the regions read out of the store and not updated since (the non-owners': "master",
        # their weights): the store's copy of a resident group changes only through write_back
        self._loaded: set[StateRegion] = set()
        self.load(moments=False)  # a fresh run's moments are the zeros above; resume: start_at

    def holds(self, group: int) -> bool:
        return group in self._groups

    def owns(self, group: int) -> bool:
        """Whether this rank holds the group's state and updates it."""
        return self.owners is None or self.owners.ctx.owns(group)

    def buffer(self, group: int) -> DeviceBuffer:
        """The group's weights, always current (never loaded through the window): ``ready``
        first."""
        self.ready(group)
        return self._groups[group].weights

    def ready(self, group: int) -> None:
        """The current stream waits for the group's pending update, if any: before its weights
        are used (the engine's embedding and head keep their buffer and call this each step)."""
        event = self._updated.pop(group, None)
        if event is not None:
            torch.cuda.current_stream(self.device).wait_event(event)

    def _settle(self) -> None:
        """The current stream waits for every update issued (before the state is copied)."""
        if self._stream is not None:
            torch.cuda.current_stream(self.device).wait_stream(self._stream)
        self._updated.clear()

    @property
    def state_bytes(self) -> int:
        """Device bytes of the FP32 master and moments (the weights count in the window's)."""
        return sum(t.numel() * t.element_size() for g in self._groups.values()
                   for t in g.state.values())  # fmt: skip

    def load(self, *, moments: bool = True) -> None:
        """Copy the resident groups' state out of the store (resume: ``Engine.start_at``).
        ``moments=False`` (the engine's start): the master weights only, the moments left as
        they are (zero): a fresh store's are zero too, and reading them would fault in every
        never-touched page of them on each owner (two thirds of the bytes). A group another
        rank owns takes its weights from the store's BF16 mirror where there is one (half the
        bytes of the master, page-locked on CUDA, no cast on the host). A region read before
        and not updated since is not read again (a resume reads the master once, at the
        engine's start, and the moments once, in ``start_at``)."""
        self._settle()
        if self._dirty:
            self._loaded.clear()
        regions = [r for r in (REGIONS if moments else ("master",)) if r not in self._loaded]
        self._loaded.update(regions)
        self._dirty = False
        for g in self._groups.values():
            for region in regions if g.state else ():
                g.state[region].copy_(self.store.group_state(g.group, region))
            if "master" not in regions:
                continue  # the weights are the master's already
            if g.state:  # cast where the master is
                self._cast_weights(g, g.state["master"])
            elif self.store.has_mirror and g.weights.flat.dtype == torch.bfloat16:
                # the master's cast already, bit for bit torch's (test_kernels_parity)
                mirror = self.store.mirror_group(g.group)
                g.weights.flat[: mirror.numel()].copy_(mirror)
            else:
                self._cast_weights(g, self.store.group_state(g.group, "master"))

    def write_back(self) -> None:
        """Copy the resident state into the store (and its BF16 mirror, which then equals an
        all-host run's): a checkpoint or an export of the store is then the all-host one.
        Several ranks: each owner writes its groups, then the node's ranks meet (a collective:
        every rank drains at the same points), so the checkpoint that follows has them all."""
        self._settle()
        if not self._dirty:
            return
        self._dirty = False
        self._loaded = set(REGIONS)  # the store's copy is the device's again
        for g in self._groups.values():
            if not g.state:
                continue
            for region in REGIONS:
                self.store.group_state(g.group, region).copy_(g.state[region])
            if self.store.has_mirror:
                mirror = self.store.mirror_group(g.group)
                for p in g.params:
                    self.kernels.cast_f32_to_bf16(
                        self.store.param(p.name).view(-1), mirror[p.slot_at : p.slot_at + p.numel]
                    )
        if self.owners is not None:
            collective(functools.partial(dist.barrier, group=self.owners.group))

    @staticmethod
    def _cast_weights(g: _Group, master: torch.Tensor) -> None:
        """The weights from ``master`` (the group's f32 state layout, here or in the store)."""
        for p in g.params:
            g.weights.flat[p.slot_at : p.slot_at + p.numel].copy_(
                master[p.state_at : p.state_at + p.numel]
            )

    def keep(self, ticket: GradTicket, adam: AdamArgs) -> None:
        """A resident group's gradient from the backward, kept until ``update``."""
        self._pending.append((ticket, adam))

    def discard(self) -> None:
        """The step failed before any update was applied: forget its gradients (an update
        issued for them was gated off: see ``update``)."""
        self._pending.clear()
        self._issued.clear()

    def update(self, coef: torch.Tensor, finite: torch.Tensor | None = None) -> None:
        """Issue AdamW on every kept gradient, scaled by ``coef`` (the clip coefficient, a
        0-d device tensor: no host sync), and the weights' cast. It is applied only where
        ``finite`` (a 0-d device bool: the global norm's) holds, by default where every kept
        gradient's norm is finite: the caller checks afterwards (the host waits for the
        backward then) and on failure nothing was applied, so the issue can run before that
        wait and its launches overlap the backward. On CUDA it runs on the update stream,
        after everything issued on the current one. Several ranks: every rank calls it each
        step (it broadcasts the owners' weights). ``publish`` (success) or ``discard``
        (failure) follows."""
        self._dirty = True
        if not self._pending and self.owners is None:
            return
        scale = None
        if self._pending:
            # forward order: the next forward's first layers wait the least
            self._pending.sort(key=lambda kept: kept[0].group)
            if finite is None:  # check_finite names the group from these
                self._norms = torch.stack([torch.linalg.vector_norm(torch.stack(tk.norms))
                                           for tk, _ in self._pending])  # fmt: skip
                finite = torch.isfinite(self._norms).all()
            scale = torch.stack([coef.float(), finite.float()])  # what adamw_tensor gates on
        if self._stream is None:
            self._update_and_share(scale)
            return
        self._stream.wait_stream(torch.cuda.current_stream(self.device))
        if scale is not None:
            scale.record_stream(self._stream)
        with torch.cuda.stream(self._stream):
            self._update_and_share(scale)

    def _update_and_share(self, scale: torch.Tensor | None) -> None:
        if scale is not None:
            self._update(scale)
        if self.owners is not None:
            self._share_weights(self.owners)

    def _share_weights(self, owners: Owners) -> None:
        """Each trained group's weights from its owner to the node's other ranks, in forward
        order (the same on every rank); gated-off updates broadcast the unchanged weights."""
        for g in self._groups.values():
            if not g.trained:
                continue
            owner = owners.ctx.node_rank_of(owners.ctx.owner(g.group))
            collective(functools.partial(dist.broadcast, g.weights.flat, owner, owners.group))
            if self._stream is not None:
                self._updated[g.group] = new_event()
                self._updated[g.group].record(self._stream)

    def _update(self, scale: torch.Tensor) -> None:
        hyper: dict[AdamArgs, dict[bool, torch.Tensor]] = {}  # one copy per distinct args
        apply = self._stream is not None or bool(scale[1])  # the host path gates here
        for ticket, adam in self._pending:
            g = self._groups[ticket.group]
            # the version only names what is published: the step's groups share one key
            args = replace(adam, version=0)
            grads = {p.name: ticket.grads[p.name].reshape(-1) for p in g.trained}
            if self._stream is not None:
                if args not in hyper:
                    hyper[args] = {d: hyperparameters(args, d, self.device) for d in (True, False)}
                adamw_single_pass(g, grads, hyper[args], scale, _compiled_pass())
                for grad in grads.values():  # allocated on the compute stream, read on this one
                    grad.record_stream(self._stream)
                self._updated[g.group] = new_event()
                self._updated[g.group].record(self._stream)
            elif apply:
                self._host_adamw(g, grads, replace(args, grad_scale=float(scale[0])))
                self._cast_weights(g, g.state["master"])
            self._issued.append((ticket.group, adam.version))
            ticket.grads.clear()
        self._pending.clear()

    def check_finite(self, step: int) -> None:
        """After ``update`` without ``finite`` (no clipping: each group's update needs a finite
        gradient; the host lane checks the streamed ones): raises, naming the first non-finite
        group in forward order, if the gate kept the update from being applied. One host
        sync."""
        if not self._issued or bool(torch.isfinite(self._norms).all()):
            return
        for (group, _), norm in zip(self._issued, self._norms.tolist(), strict=True):
            if not math.isfinite(norm):
                self.discard()
                name = self.store.layout.groups[group].name
                raise NonFiniteError(  # the streamed groups' updates overlapped the backward
                    f"step {step}: the gradient of '{name}' is not finite ({norm}); no resident "
                    "layer's update of this step was applied",
                    step=step,
                    what="grad_norm",
                )

    def publish(self) -> None:
        """The issued updates were applied: each group's version published through the update
        worker's queue, as the streamed groups' are."""
        for group, version in self._issued:
            self.worker.submit(group, 0, 0, 0, step=1, lr=0.0, betas=(0.0, 0.0), eps=1.0,
                               weight_decay=0.0, publish=version)  # fmt: skip
        self._issued.clear()

    def _host_adamw(self, g: _Group, grads: dict[str, torch.Tensor], a: AdamArgs) -> None:
        for p in g.trained:
            self.kernels.adamw(
                g.view("master", p),
                g.view("exp_avg", p),
                g.view("exp_avg_sq", p),
                grads[p.name],
                lr=a.lr,
                betas=a.betas,
                eps=a.eps,
                weight_decay=a.weight_decay if p.decays else 0.0,
                step=a.step,
                grad_scale=a.grad_scale,
            )


def hyperparameters(a: AdamArgs, decays: bool, device: torch.device) -> torch.Tensor:
    """What ``adamw_tensor`` reads besides the gradient's scale, as one f32 device tensor (a
    tensor, not Python floats, so that a changing learning rate never recompiles the pass; on
    CUDA copied from page-locked memory, so that issuing it never waits for the stream): lr *
    weight decay (0 for the tensors that do not decay), beta1, 1 - beta1, beta2, 1 - beta2,
    eps, lr / bias correction 1, sqrt(bias correction 2)."""
    (b1, b2), decay = a.betas, a.lr * a.weight_decay if decays else 0.0
    bc1, bc2 = 1.0 - b1**a.step, 1.0 - b2**a.step
    values = [decay, b1, 1.0 - b1, b2, 1.0 - b2, a.eps, a.lr / bc1, math.sqrt(bc2)]
    cuda = device.type == "cuda"
    host = torch.tensor(values, dtype=torch.float32, pin_memory=cuda)
    return host.to(device, non_blocking=cuda)


def adamw_tensor(
    master: torch.Tensor,
    exp_avg: torch.Tensor,
    exp_avg_sq: torch.Tensor,
    grad: torch.Tensor,
    weight: torch.Tensor,
    hp: torch.Tensor,
    scale: torch.Tensor,
) -> None:
    """AdamW on one flat tensor in place, as torch's fused AdamW computes it (decoupled decay
    first, then the moments, then the step over √v / √bc2 + eps), the compute-dtype ``weight``
    cast from the new master; ``hp`` from ``hyperparameters``, ``scale``: the gradient's scale
    and whether to apply the update at all (0: master, moments and weights are left as they
    are, whatever the scale). Compiled, it is one pass."""
    g = grad.float() * scale[0]
    apply = scale[1] > 0
    new_master = master - hp[0] * master
    new_avg = exp_avg * hp[1] + hp[2] * g
    new_avg_sq = exp_avg_sq * hp[3] + hp[4] * g * g
    new_master = new_master - hp[6] * new_avg / (new_avg_sq.sqrt() / hp[7] + hp[5])
    master.copy_(torch.where(apply, new_master, master))
    exp_avg.copy_(torch.where(apply, new_avg, exp_avg))
    exp_avg_sq.copy_(torch.where(apply, new_avg_sq, exp_avg_sq))
    weight.copy_(master)  # the weights are the master's cast: unchanged with it


@functools.cache
def _compiled_pass() -> Callable[..., None]:
    """``adamw_tensor`` compiled once per process (dynamic shapes: one kernel for every size),
    in this process: inductor's pool of one worker process per core takes ~0.35 GiB of host
    memory each while it lives, at the run's first step, when the store and the offload arena
    are already in place (on Qwen3-8B it took the host past its memory:
    benchmarks/2026-11-25-autopolicy-h100.md, "Qwen3-8B, B=16: the OOM kill"); one small
    kernel gains nothing from it. The setting is the compile's own option, so the ~400 calls a
    step pay nothing for it (a ``config.patch`` around each took ~20 us).

    Without autotuning: the pass writes its inputs in place, so inductor's autotuner, timing
    its configs at the first call, saves each written input larger than the headroom under the
    run's GPU memory peak so far to *pinned host memory* (``copy_args_to_cpu_if_needed``), in
    blocks of torch's pinned cache (powers of two, never given back). For Qwen3-8B's embedding
    (2.3 GiB of f32 per state) that pinned 3 x 4 GiB beside the store and the mirror and the
    OOM killer ended the run (same record and section). The cost, on the H100: the untuned
    config takes 54 ms per update of Qwen3-4B's 4.02 B parameters against 42 ms autotuned
    (56 ms autotuned first on a small scratch instead, so that was not kept)."""
    return _TracedWithoutDuckSizing(
        torch.compile(
            adamw_tensor,
            dynamic=True,
            options={"compile_threads": 1, "triton.autotune_pointwise": False},
        )
    )


class _TracedWithoutDuckSizing:
    """``kernel``'s first call, the one that traces it, without duck sizing: with it, a first
    call where two sizes are equal (a resident embedding: its one tensor spans its group's
    state and buffer) guards on that equality and the next group's update compiles the pass
    again, one more compile in the first step. Later calls go straight through."""

    def __init__(self, kernel: Callable[..., None]) -> None:
        self.kernel, self.traced = kernel, False

    def __call__(self, *args: torch.Tensor) -> None:
        if self.traced:
            self.kernel(*args)
            return
        with fx_config.patch(use_duck_shape=False):  # type: ignore[attr-defined]  # set at import
            self.kernel(*args)
        self.traced = True


def adamw_single_pass(
    g: _Group,
    grads: dict[str, torch.Tensor],
    hyper: dict[bool, torch.Tensor],
    scale: torch.Tensor,
    kernel: Callable[..., None],
) -> None:
    """One group's update, tensor by tensor, with ``kernel`` (``adamw_tensor`` or its compiled
    pass); ``hyper``: ``hyperparameters`` for the decayed (True) and undecayed tensors;
    ``scale``: ``adamw_tensor``'s."""
    for p in g.trained:
        kernel(g.view("master", p), g.view("exp_avg", p), g.view("exp_avg_sq", p),
               grads[p.name], g.weights.flat[p.slot_at : p.slot_at + p.numel],
               hyper[p.decays], scale)  # fmt: skip
