"""The gradient-sync protocol of a step: where each group's gradient goes once the backward
produced it, and when its update may start.

Without clipping a group's gradient goes to its owner and the host at once (AdamW overlaps the
backward). With exact clipping the step's gradients are parked on the device with their norms;
``finish`` computes ``clip_grad_norm_``'s coefficient and they leave in forward order, a ring's
worth before each load of the next step (``send_ready``). On the cpu route each is sent twice
(for the host sum's Σ g², then with the coefficient). GPU-resident groups stay on the device
(reduced onto their owner) and count once in the norm. Invariant: no update of a step starts
before its coefficient is known.

Example::

    sync = GradSync(grads, reduce, optim, ctx, device)
    sync.hand_over(ticket, t, adam_step, lr)   # per group; then end_backward(), finish(t)
"""

from __future__ import annotations

import math
from dataclasses import replace

import torch

from slidedp.errors import NonFiniteError
from slidedp.plan.policy import OptimConfig
from slidedp.runtime.dist import Dist, all_reduce_sum
from slidedp.runtime.grad_lane import AdamArgs, GradLane, GradTicket
from slidedp.runtime.resident import ResidentLayers
from slidedp.runtime.routes import GpuReduce
from slidedp.store_layout import StoreLayout


class GradSync:
    def __init__(
        self,
        grads: GradLane,
        reduce: GpuReduce | None,
        optim: OptimConfig,
        ctx: Dist | None,
        device: torch.device,
        resident: ResidentLayers | None = None,
    ) -> None:
        self.grads, self.reduce, self.optim, self.ctx, self.device = (
            grads, reduce, optim, ctx, device
        )  # fmt: skip
        self.resident = resident
        self._tickets: list[GradTicket] = []  # this rank's owned gradients of the step
        # clipping: this step's gradients, parked until the clip coefficient is known; then the
        # ones ready to leave (with the coefficient), in forward order
        self._parked: list[tuple[GradTicket, AdamArgs]] = []
        self._ready: list[tuple[GradTicket, AdamArgs]] = []

    @property
    def clipping(self) -> bool:
        return self.optim.max_grad_norm > 0

    def host_update_order(self, layout: StoreLayout) -> list[int]:
        """The groups with trained parameters that this rank's worker updates on the host, in
        the order of their first updates: forward order with clipping (``finish`` sends them
        so), backward order without (as the backward hands them over)."""
        held = self.resident.holds if self.resident is not None else (lambda group: False)
        groups = [g for g, group in enumerate(layout.groups)
                  if group.trained_len and self.grads.owns(g) and not held(g)]  # fmt: skip
        return groups if self.clipping else groups[::-1]

    def begin_step(self) -> None:
        self._tickets = []

    def _adam(self, t: int, adam_step: int, lr: float) -> AdamArgs:
        o = self.optim
        return AdamArgs(adam_step, lr, o.betas, o.eps, o.weight_decay, 1.0, t + 1)

    def hand_over(self, local: GradTicket, t: int, adam_step: int, lr: float) -> None:
        """A group's gradient is issued: reduced onto its owner (gpu route), then sent now
        (overlap) or parked (clipping); a resident group's stays on the device until ``finish``."""
        ticket = local if self.reduce is None else self.reduce.reduce(local)
        if ticket is None:
            return  # another rank owns this group
        if self.resident is not None and self.resident.holds(local.group):
            self._tickets.append(ticket)
            self.resident.keep(ticket, self._adam(t, adam_step, lr))
            return
        self._tickets.append(ticket)
        adam = self._adam(t, adam_step, lr)
        if self.clipping:
            self._parked.append((ticket, adam))
            if self.grads.host_sum is not None:  # the norm is the host sum's: sum it now
                self.grads.flush(keep_last_group=True)
                self.grads.send(ticket, adam, check_finite=False, role="norm")
            return
        if self.grads.host_sum is None:
            # Submit everything queued (the previous group's copy was issued a layer's backward
            # ago), so this send takes a slot whose update ran long ago, not the one just
            # submitted: that would serialize the backward with the update lane.
            self.grads.flush()
        else:  # summing the newest group on the host would wait for slower peers
            self.grads.flush(keep_last_group=True)
        self.grads.send(ticket, adam, check_finite=True)

    def end_backward(self) -> None:
        if not self.clipping or self.grads.host_sum is not None:
            # no clipping: a non-finite gradient surfaces in its own step; cpu route with
            # clipping: every owner's Σ g² is in before the norm is all-reduced
            self.grads.flush()

    def _global_norm(self) -> torch.Tensor:
        """‖gradient of the global batch‖₂: from the local norms, or across the owners."""
        all_norms = [n for tk in self._tickets for n in tk.norms]
        if self.ctx is None:
            total: torch.Tensor = torch.linalg.vector_norm(torch.stack(all_norms))
            return total  # clip_grad_norm_'s total
        if self.grads.host_sum is not None:  # cpu route: Σ g² of the summed host chunks
            owned = self.grads.take_sum_squares()
        else:
            owned = float(torch.stack(all_norms).double().square().sum()) if all_norms else 0.0
        # every node's owners hold the same (all-nodes) sums: add up one node's
        node = self.ctx.node_group
        # on the device, as the local norm: the resident update and its gate read it there
        norm = math.sqrt(all_reduce_sum([owned], self.device, node)[0])
        return torch.tensor(norm, device=self.device)

    def finish(self, t: int) -> tuple[float, float]:
        """``(global norm, clip coefficient)``; with clipping, the parked gradients get the
        coefficient and start leaving. The resident groups' update is issued before the host
        waits for the norm (it is gated on the norm being finite), so that its launches
        overlap the end of the backward."""
        total = self._global_norm()
        if not self.clipping:
            if self.resident is not None:
                self.resident.update(torch.ones((), device=total.device))
            grad_norm = float(total)
            if self.resident is not None:
                self.resident.check_finite(t)
                self.resident.publish()
            return grad_norm, 1.0
        clip = torch.clamp(self.optim.max_grad_norm / (total + 1e-6), max=1.0)
        if self.resident is not None:
            self.resident.update(clip, torch.isfinite(total))
        grad_norm = float(total)
        if not math.isfinite(grad_norm):
            self.discard()
            raise NonFiniteError(
                f"step {t}: the gradient norm is not finite ({grad_norm}); "
                "no update of this step was applied",
                step=t,
                what="grad_norm",
            )
        coef = float(clip)
        assert not self._ready, "the previous step's gradients are all sent by now"
        self._parked.sort(key=lambda parked: parked[0].group)  # forward order
        self._ready = [(tk, replace(adam, grad_scale=coef)) for tk, adam in self._parked]
        self._parked = []
        if self._ready:  # the updates start now, not when the next step first loads
            self.send_ready(self._ready[0][0].group)
        if self.resident is not None:
            self.resident.publish()
        return grad_norm, coef

    def send_ready(self, group: int) -> None:
        """Before a load waits for ``group``'s version: submit the chunks sent by earlier calls
        (their copies are done by now), so the update worker is never idle while this thread
        waits; then send the ready gradients up to ``group`` and a ring's worth ahead (sending
        into a full ring waits for the oldest update: the backpressure)."""
        if self._ready:
            self.grads.flush()
        ahead = group + self.grads.slot_count
        while self._ready and self._ready[0][0].group <= ahead:
            ticket, adam = self._ready.pop(0)
            self.grads.send(ticket, adam, check_finite=False, role="update")
        if self.grads.host_sum is not None:
            self.grads.flush()  # peers may be waiting for any queued chunk (routes.HostSum)
        else:
            self.grads.flush(through_group=group)

    def discard(self) -> None:
        """The step failed before any update: forget its parked gradients."""
        self._parked.clear()
        if self.resident is not None:
            self.resident.discard()

    def send_all(self, num_groups: int) -> None:
        """Send every ready gradient and submit everything queued."""
        if self._ready:
            self.send_ready(num_groups)
        self.grads.flush()
