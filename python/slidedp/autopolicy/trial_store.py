"""One host store for the trials of a selection in one process (``TrialStores``).

Most of a trial's setup is its host store: /dev/shm allocated and zero-filled, the weights
initialised or loaded into it, the BF16 mirror cast (Qwen3-4B: 64 GB). Its layout follows the
model, the chunk, the slot rings and the mirror, not the layer policy nor what stays
GPU-resident, so the trials of one stage (calibration's reduced model, validation's run) share
one: ``TrialStores.trainer`` hands a trial's trainer the held store where its layout, model and
seed agree (every version back to 0), else drops it and holds the one the trainer creates.
Invariants: a trial's step time is that of a fresh store (``trainer`` says why); one process,
one rank; a trial that fails drops the store.

Example::

    stores = TrialStores()
    times = stores.trainer(cfg).timed_steps(3)   # the next trial of the same layout reuses it
"""

from __future__ import annotations

import dataclasses
import gc
import json

import torch

from slidedp.config import TrainConfig
from slidedp.models.freeze import apply_freeze
from slidedp.models.hf import HFAdapter
from slidedp.plan.machine import Machine
from slidedp.plan.policy import Plan, store_args
from slidedp.plan.resolve import resolve_plan
from slidedp.runtime.trainer import Trainer
from slidedp.store import HostStore


class TrialStores:
    """The store of the last trial, kept for the next one of the same layout."""

    def __init__(self) -> None:
        self._key: str | None = None
        self._store: HostStore | None = None
        self.created = 0  # stores the trainers created
        self.reused = 0  # trials that ran on a held store

    def trainer(self, cfg: TrainConfig) -> Trainer:
        """A trainer of ``cfg`` (a trial's config: no resume) on the held store where it fits,
        else on a store of its own, held from then on."""
        adapter = apply_freeze(
            HFAdapter.from_dir(cfg.model.path, cfg.model.config_overrides()), cfg.train.freeze
        )
        plan = resolve_plan(cfg, adapter, self._machine(cfg))
        key = self._key_of(cfg, adapter, plan)
        # The held store gives the same step time: the trial runs the same batches at the same
        # steps with the same plan; only values differ (the weights by an earlier trial's few
        # updates, the Adam moments not zero) and no step's time depends on them: AdamW is the
        # same elementwise pass over every element, a dense layer's matmuls never look at the
        # values (a mixture of experts routes by its weights, which a few updates barely move),
        # and a fresh trial's timed steps (after the first) already run on updated weights and
        # non-zero moments. So neither the moments nor Adam's step are reset.
        if key == self._key and self._store is not None:
            store = self._store
            for group in range(store.num_groups):  # the engine starts at step 0
                store.publish(group, 0)
            self.reused += 1
            return Trainer(cfg, plan, log=False, store=store)
        self.drop()
        trainer = Trainer(cfg, plan, log=False)
        self._key, self._store = key, trainer.store
        self.created += 1
        return trainer

    @property
    def held(self) -> HostStore | None:
        return self._store

    def drop(self) -> None:
        """Release the held store (after a failed trial: its state is mid-step)."""
        self._key, self._store = None, None
        gc.collect()  # its mapping, before another is made

    def _machine(self, cfg: TrainConfig) -> Machine:
        """The machine a fresh trial process would see: the held store's bytes free (the BF16
        mirror is decided on it; the held store is dropped before another is created)."""
        machine = Machine.probe(cfg, measure=False)
        held = 0 if self._store is None else self._store.total_bytes
        available = machine.mem_available_bytes
        return dataclasses.replace(
            machine,
            shm_free_bytes=machine.shm_free_bytes + held,
            mem_available_bytes=None if available is None else available + held,
        )

    @staticmethod
    def _key_of(cfg: TrainConfig, adapter: HFAdapter, plan: Plan) -> str:
        """What a trial's store holds: its layout, and where its weights came from."""
        args = store_args(plan.policy, bf16=plan.dtype == torch.bfloat16, world=1)
        layout = HostStore.plan(adapter.group_specs(), **args)
        return json.dumps([layout.to_json(), repr(cfg.model), cfg.train.seed], sort_keys=True)
