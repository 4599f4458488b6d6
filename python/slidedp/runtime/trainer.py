"""The training loop behind ``slidedp train CONFIG.yaml [section.key=value ...]``.

Builds the model adapter, the host store (master weights loaded or initialised, or the whole
state of the checkpoint ``train.resume`` names), the data and the engine; runs the steps up to
``train.max_steps`` (logging: ``runtime.train_log``), checkpoints every ``output.save_steps``,
at the end and on SIGTERM/SIGINT (``io.checkpoint``), then exports ``OUTPUT/final/`` from the
last checkpoint. A non-finite loss or gradient norm stops training before any update of that
step (``train.on_nonfinite: stop``), or skips the step (``skip``: no update, the versions move
on, ``max_consecutive_skips`` in a row at most). The data position is the step: ``batch(t)``.

Example::

    from slidedp.config import load_config
    Trainer(load_config("examples/tiny-qwen3.yaml", ["train.max_steps=5"])).run()
"""

from __future__ import annotations

import functools
import math
import os
import sys
import time
from collections.abc import Callable
from dataclasses import replace
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from slidedp.config import TrainConfig, config_to_dict
from slidedp.data.batches import Batches
from slidedp.data.build import run_data
from slidedp.errors import NonFiniteError, TrainingInterruptedError
from slidedp.io.best import BestCheckpoint
from slidedp.io.checkpoint import (
    Progress,
    Retention,
    export_final,
    restore_rng,
    save_checkpoint,
)
from slidedp.io.disk_space import checkpoint_bytes, disk_full_reported
from slidedp.io.hf_load import fill_master, read_buffers, weight_files
from slidedp.io.resume import ResumeDecision, ResumePoint, load_resume_point, plan_resume
from slidedp.kernels import default_threads
from slidedp.models.freeze import apply_freeze
from slidedp.models.hf import HFAdapter
from slidedp.models.router_loss import check_router_loss_ranks
from slidedp.plan.device import pick_device, pick_dtype
from slidedp.plan.machine import Machine
from slidedp.plan.policy import Plan, store_args, write_plan
from slidedp.plan.resolve import resolve_plan
from slidedp.profile.host import engine_update_threads
from slidedp.runtime.dist import Dist, all_reduce_sum, check_nodes_agree, start
from slidedp.runtime.engine import Engine
from slidedp.runtime.evaluate import Evaluator
from slidedp.runtime.flops import device_peak_flops, model_flops_per_token
from slidedp.runtime.kernel_warmup import KernelWarmup, warmup_spec
from slidedp.runtime.launch import LAUNCHER_PID
from slidedp.runtime.node_meet import start_facts
from slidedp.runtime.routes import share_signals
from slidedp.runtime.schedule import lr_schedule
from slidedp.runtime.startup import StartupClock, build_store
from slidedp.runtime.stop_signals import StopSignals
from slidedp.runtime.trace import write_trace
from slidedp.runtime.trackers import Trackers, open_trackers
from slidedp.runtime.train_log import LogMemory, LogSteps, RunFacts, StepLog
from slidedp.store import HostStore

if TYPE_CHECKING:
    from slidedp.preflight import Checked


class Trainer:
    def __init__(
        self,
        cfg: TrainConfig,
        plan: Plan | None = None,
        *,
        log: bool = True,
        checked: Checked | None = None,
        store: HostStore | None = None,
        decided: ResumeDecision | None = None,
    ) -> None:
        """``plan``: the run's plan, decided before (``slidedp train``: the preflight's, or the
        launcher's ``--plan`` file on every rank), run as it is; None (a direct call, a rank
        another launcher started): ``resolve_plan`` here, the mirror the store's creator's.
        ``checked``: the preflight's result (``slidedp train``), whose resume decision is
        taken as is; ``decided``: a launcher's resume decision (its other ranks), taken as is;
        without either the trainer decides (the same ``plan_resume``). ``store``: one
        process's store of ``plan``'s layout that an earlier trainer filled (the policy
        selector's trials, ``autopolicy.trial_store``), run as it is: nothing created or filled."""
        self.cfg, self.log = cfg, log
        tc, rt = cfg.train, cfg.runtime
        self.ctx = Dist.from_env()  # several ranks: see slidedp.runtime.dist
        world = 1 if self.ctx is None else self.ctx.world
        local_world = 1 if self.ctx is None else self.ctx.local_world  # ranks sharing the store
        self.device = pick_device(rt.launch.device)
        if self.ctx is not None:
            self.device = start(self.ctx, self.device, cfg)
            self.log = log and self.ctx.main  # only rank 0 logs and writes
        self.dtype = pick_dtype(tc.dtype, self.device)
        self.cuda = self.device.type == "cuda"
        torch.manual_seed(tc.seed)
        self.adapter = apply_freeze(
            HFAdapter.from_dir(cfg.model.path, cfg.model.config_overrides()), tc.freeze
        )
        check_router_loss_ranks(self.adapter, world)
        self.out_dir = Path(cfg.output.dir)
        self.resume = self._resume_point(checked, decided)
        self.progress = Progress() if self.resume is None else replace(self.resume.progress)
        bf16 = self.dtype == torch.bfloat16

        machine = Machine.probe(cfg, measure=False)
        self.startup = clock = StartupClock()  # how long each part of this build took

        def create() -> HostStore:  # every rank gets its own range of the slot rings
            # decided once, by the creator: the others attach to what it made
            policy = (plan or resolve_plan(cfg, self.adapter, machine)).policy
            args = store_args(policy, bf16=bf16, world=local_world, nodes=world // local_world)
            store, self.source = build_store(self.adapter, args, self._fill_state, clock)
            return store

        warm = warmup_spec(cfg, self.adapter, self.device) if store is None else None
        with KernelWarmup(warm) as warmup:  # the ranks warm their kernels meanwhile
            self._open_store(store, create)
            with clock.part("kernels_s"):
                clock.note(warmup.finish())
        clock.warmup_s = warmup.ran_s
        weights = self.resume.path if self.resume is not None else self.adapter.path
        read_buffers(self.adapter, weight_files(weights) if weights is not None else [])
        with clock.part("data_s"):
            self.data, held_out = self._read_data()  # all of it, checked, before any GPU work
        self.lr_at = lr_schedule(tc.lr_scheduler, tc.learning_rate, tc.warmup_steps, tc.max_steps)
        if plan is None:  # every rank resolves: the store's mirror is what its creator decided
            plan = resolve_plan(cfg, self.adapter, machine, mirror=self.store.has_mirror)
            plan = replace(plan, threads=rt.layout.update_threads or self._default_host_threads())
        self.plan = replace(plan, device=self.device)  # this rank's device of the plan's kind
        self.policy = self.plan.policy
        with clock.part("engine_s"):
            self.engine = Engine(
                self.adapter, self.store, self.plan, ctx=self.ctx, signals=self.signals
            )
        self.evaluator = None if held_out is None else Evaluator(self.engine, held_out)
        self.best = BestCheckpoint(self.out_dir, cfg.data.eval_path)
        if self.ctx is not None:
            check_nodes_agree(self.ctx, functools.partial(start_facts, self))
        if self.resume is not None:
            self.engine.start_at(self.progress.step)
            restore_rng(self.resume.rng)  # last: building the trainer draws random numbers

    def _resume_point(
        self, checked: Checked | None, decided: ResumeDecision | None
    ) -> ResumePoint | None:
        """The preflight's resume decision, else the launcher's, else this rank's own (the same
        ``plan_resume``)."""
        if checked is not None:
            return checked.resume
        if decided is not None:
            return decided.point
        return plan_resume(self.cfg.train, self.cfg.data, self.out_dir, self.adapter)

    def _open_store(self, store: HostStore | None, create: Callable[[], HostStore]) -> None:
        """``store`` as given, else one this rank ``create``s, else (several ranks) the one its
        node's local rank 0 creates and fills, which the others attach to, with the signals."""
        self.signals: HostStore | None = None
        self.node_pids: tuple[int, ...] = (os.getpid(),)  # the ranks whose host PSS the log sums
        if store is not None:  # one rank (the docstring's contract)
            self.store, self.source = store, "an earlier trial's store"
        elif self.ctx is None:
            self.store = create()
        else:
            self.source = "shared by local rank 0"
            self.store = self.ctx.share_store(create)
            bf16 = self.dtype == torch.bfloat16
            self.signals = share_signals(self.ctx, self.store, self.cfg.runtime.layout, bf16)
            self.node_pids = tuple(self.ctx.node_pids())

    def _read_data(self) -> tuple[Batches, Batches | None]:
        """The training batches and the held-out ones (None: no held-out data)."""
        cfg, model = self.cfg, self.adapter
        return run_data(cfg, model.config, model.vocab_size)  # each file read once

    def _fill_state(self, store: HostStore) -> str:
        """Master weights (and Adam moments when resuming) into the store; says from where."""
        if self.resume is None:
            return fill_master(self.adapter, store, self.cfg.train.seed)
        load_resume_point(self.resume, self.adapter, store)
        return f"resumed from {self.resume.path} (step {self.progress.step})"

    def _default_host_threads(self) -> int:
        """This rank's share of the cores but one for host kernels on GPU; on CPU, half of it (torch
        computes on the rest: two thread pools spinning on the same cores slow each step down
        ~10x). ``engine_update_threads`` says why a share."""
        ranks = 1 if self.ctx is None else self.ctx.local_world
        return engine_update_threads(default_threads(), self.device.type == "cuda", ranks)

    def _facts(self) -> RunFacts:
        a, tc = self.adapter, self.cfg.train
        window, resident = self.engine.window, self.engine.resident
        held = f"{window.param_bytes():,} B"  # the resident layers' weights included
        if resident is not None:
            held += f" + {resident.state_bytes:,} B resident FP32 master and moments"
        return RunFacts(
            model=f"{a.config.model_type} ({self.cfg.model.path}, {self.source})",
            params=sum(self.store.param(n).numel() for _, n in a.iter_params()),
            layers=a.num_layers,
            ranks=1 if self.ctx is None else self.ctx.world,
            global_batch_size=tc.global_batch_size,
            seq_len=self.cfg.data.seq_len,
            start_step=self.progress.step,
            max_steps=tc.max_steps,
            resumed_from=None if self.resume is None else str(self.resume.path),
            store_bytes=self.store.total_bytes,
            pinned_bytes=sum(view.numel() for view in self.engine.pinned),  # byte views
            device=str(self.device),
            dtype=str(self.dtype).removeprefix("torch."),
            window=f"{len(window.slots)} layer slots, {held}",
            policy=self.policy.describe() + self._policy_source(),
            compute=self.policy.compute.describe(),
            isa=self.engine.kernels.isa,
            threads=self.engine.kernels.threads,
            peak_flops=device_peak_flops(self.device),
            nodes=1 if self.ctx is None else self.ctx.nodes,
            context_parallel=self.cfg.runtime.launch.context_parallel,
            startup=self.startup.line(self.engine.pin_s, self.engine.resident_s),
        )

    def _policy_source(self) -> str:
        """Where a policy file's keys came from (``runtime.policy: FILE``, as `slidedp plan`
        writes it); `runtime.policy: auto` says its own line before the run."""
        source = self.cfg.runtime.autopolicy.policy
        return f" (from the policy file {source})" if source not in ("", "auto", "fixed") else ""

    def _step(self, t: int) -> dict[str, Any]:
        """Step ``t`` (0-based), or its skip under ``on_nonfinite: skip``; its metrics record."""
        tc, p = self.cfg.train, self.progress
        batch = self.data.batch(t)
        lr = self.lr_at(t)
        record: dict[str, Any] = {"step": t + 1}
        rt = self.cfg.runtime
        tracing = bool(rt.trace.trace_path) and t == rt.trace.trace_step
        if tracing:
            self.engine.start_trace()
        start = time.perf_counter()
        try:
            result = self.engine.step(t, batch, lr, adam_step=p.adam_step + 1)
        except NonFiniteError as e:
            if tc.on_nonfinite == "stop":
                raise
            self.engine.skip(t)
            p.skipped_steps += 1
            p.consecutive_skips += 1
            if p.consecutive_skips > tc.max_consecutive_skips:
                raise NonFiniteError(
                    f"step {t}: {p.consecutive_skips} non-finite steps in a row, more than "
                    f"train.max_consecutive_skips={tc.max_consecutive_skips}; stopped (last: {e})",
                    step=t,
                    what=e.what,
                ) from None
            record |= {"skipped": True, "nonfinite": e.what}
        else:
            p.adam_step += 1
            p.consecutive_skips = 0
            record |= {
                "loss": result.loss,
                "grad_norm": result.grad_norm,
                "clip_coef": result.clip_coef,
                "label_tokens": result.label_tokens,
            }
            if result.aux_loss is not None:
                record["aux_loss"] = result.aux_loss
        step_time_s = time.perf_counter() - start
        p.step = t + 1
        lanes = self.engine.lane_times()
        if tracing:
            write_trace(Path(rt.trace.trace_path), self.engine.stop_trace(t))
        return (
            record
            | {
                "lr": lr,
                "tokens": batch.tokens,
                "seq_len": int(batch.input_ids.shape[1]),
                "step_time_s": round(step_time_s, 6),
                "tokens_per_s": round(batch.tokens / step_time_s, 1),
                **lanes,
            }
            | ({"gpu_max_allocated_bytes": torch.cuda.max_memory_allocated()} if self.cuda else {})
        )

    def save(self) -> Path:
        """Checkpoint the state after ``progress.step`` steps (the update lane drained first)."""
        self.engine.drain()
        tc, data = self.cfg.train, self.cfg.data
        meta = {
            "world_size": 1,  # the state does not depend on it: a resume may use other ranks
            "policy": self.policy.to_dict(),  # how it ran
            "plan": self.plan.to_json(),  # what a resume keeps (plan.resolve.kept_plan)
            "model": {"model_type": self.adapter.config.model_type, "path": self.cfg.model.path},
            "train": {
                "global_batch_size": tc.global_batch_size,
                "max_steps": tc.max_steps,
                "seed": tc.seed,
                "max_grad_norm": tc.max_grad_norm,
                "freeze": tc.freeze,
            },
            "lr_schedule": {
                "name": tc.lr_scheduler,
                "learning_rate": tc.learning_rate,
                "warmup_steps": tc.warmup_steps,
                "max_steps": tc.max_steps,
                "last_lr": self.lr_at(self.progress.step - 1) if self.progress.step else None,
            },
            "data": data.checkpoint_record(next_step=self.progress.step),
        }
        one_bytes = checkpoint_bytes(self.adapter)
        with disk_full_reported(self.out_dir, one_bytes):  # ENOSPC: one line, exit 2
            return save_checkpoint(
                self.out_dir,
                self.adapter,
                self.store,
                self.progress,
                meta,
                retention=self._retention(),
            )

    def _retention(self) -> Retention:
        return Retention(
            total_limit=self.cfg.output.save_total_limit,
            set_aside=() if self.resume is None else self.resume.set_aside,
            keep=self.best.kept(),
        )

    def run(self) -> list[dict[str, Any]]:
        """The remaining steps; returns their metrics records (also in ``metrics.jsonl``).
        The engine's page-locked host memory is released at the end, success or not. A failed
        host update is reported as itself, whatever error it caused first."""
        try:
            return self._run()
        except Exception:
            # this process's update worker failed and poisoned the store: its error is the one
            # to report, not what a waiter (here or in a peer, then a collective) woke with
            self.engine.worker.raise_failure()
            raise
        finally:
            self.engine.close()

    def timed_steps(self, count: int) -> list[float]:
        """The seconds of ``count`` steps from the start, nothing logged or written (the policy
        selector's validation, ``autopolicy.validate``); the engine is closed after."""
        try:
            times = [float(self._step(t)["step_time_s"]) for t in range(count)]
            self.engine.drain()
            return times
        except Exception:
            self.engine.worker.raise_failure()
            raise
        finally:
            self.engine.close()

    def _run(self) -> list[dict[str, Any]]:
        tc, out = self.cfg.train, self.cfg.output
        main = self.ctx is None or self.ctx.main
        log = self._step_log() if main else None
        if main:  # the plan this run trains with, beside its metrics
            write_plan(self.plan, self.out_dir)
        records: list[dict[str, Any]] = []
        start_step = self.progress.step
        best_at_end: float | None = None
        try:
            with StopSignals(absorb_repeats=LAUNCHER_PID in os.environ) as stop:
                for t in range(self.progress.step, tc.max_steps):
                    record = self._step(t)
                    last = t + 1 == tc.max_steps
                    record |= self._evaluate_if_due(t + 1, last)
                    if log is not None:
                        records.append(log.step(record))
                    best = out.save_best and self.best.improves(record.get("eval_loss", math.inf))
                    stopping = self._stop_agreed(stop.received is not None) and not last
                    due = bool(out.save_steps) and (t + 1) % out.save_steps == 0 and not last
                    saved = (
                        self._save_or_drain() if stopping or ((due or best) and not last) else None
                    )
                    if log is not None and (due or best) and not stopping and saved is not None:
                        log.say(f"saved {saved}")
                    if best and saved is not None:
                        self.best.mark(saved, record["eval_loss"], self._retention())
                    elif best:
                        best_at_end = record["eval_loss"]
                    if stopping:
                        by = stop.received.name if stop.received else "a signal to another rank"
                        raise TrainingInterruptedError(
                            f"stopped by {by} after step {t + 1}: saved {saved}; "
                            "continue with train.resume=auto",
                            signal_name=by,
                            step=t + 1,
                            checkpoint=str(saved),
                        )
        finally:
            if log is not None:
                log.close()
        if not main:  # rank 0 writes the last checkpoint: this rank's updates must be in
            self.engine.drain()
            return []
        last_dir = self.out_dir / f"checkpoint-{self.progress.step}"
        # a damaged checkpoint-STEP the run went past is set aside by save()
        saved_last = self.progress.step > start_step or not last_dir.exists()  # else: resumed
        if saved_last:
            last_dir = self.save()
            self._say(f"saved {last_dir}")
        if best_at_end is not None:  # the last evaluation was the best: the last checkpoint
            self.best.mark(last_dir, best_at_end, self._retention())
        if out.export:
            self._say(export_final(self.out_dir, last_dir, fresh=saved_last))
        return records

    def _step_log(self) -> StepLog:
        """Rank 0's log: the banner printed, then one line per ``output.log_steps`` steps."""
        tc, out = self.cfg.train, self.cfg.output
        self.out_dir.mkdir(parents=True, exist_ok=True)
        facts = self._facts()
        log = StepLog(
            self.out_dir,
            flops_per_token=functools.cache(
                functools.partial(model_flops_per_token, self.adapter.config)
            ),
            steps=LogSteps(total=tc.max_steps, start=self.progress.step, every=out.log_steps),
            peak_flops=facts.peak_flops,
            batch_gpus=facts.context_parallel,
            memory=LogMemory(cuda=self.cuda, node_pids=self.node_pids),
            writer=self.trackers,
            stream=sys.stdout if self.log else None,
        )
        for line in facts.lines():
            log.say(line)
        held = "" if self.evaluator is None else f"; held out: {self.evaluator.data.report}"
        log.say(f"data: {self.data.report}{held}")
        return log

    @functools.cached_property
    def trackers(self) -> Trackers | None:
        """``output.report_to``'s trackers, opened on first use (``slidedp train`` opens them
        before its first write: a W&B login or server refused as one line, nothing written)."""
        out, config = self.cfg.output, config_to_dict(self.cfg)
        return open_trackers(out.trackers(), self.out_dir, config=config,
                             plan=self._plan_record(), start_step=self.progress.step,
                             say=self._say)  # fmt: skip

    def _plan_record(self) -> dict[str, Any]:
        """What the trackers record of the plan: device, dtype, policy, host threads."""
        return {
            "device": str(self.device),
            "dtype": str(self.dtype).removeprefix("torch."),
            "policy": self.policy.to_dict(),
            "threads": self.engine.kernels.threads,
        }

    def _evaluate_if_due(self, steps: int, last: bool) -> dict[str, Any]:
        """The held-out loss after ``steps`` steps, every ``train.eval_steps`` and at the end
        (on every rank: each evaluates its rows); {} when not due or no held-out data."""
        every = self.cfg.train.eval_steps
        if self.evaluator is None or not (last or (every and steps % every == 0)):
            return {}
        return self.evaluator.run(steps)

    def _stop_agreed(self, requested: bool) -> bool:
        """Whether to stop after this step. With several ranks a signal may reach them in
        different steps (a launcher forwards it one rank at a time, a scheduler may signal only
        some): every rank stops after the step in which any rank had received one — one tiny
        all-reduce per step, at the step's end, where the host already waits for the norm."""
        if self.ctx is None:
            return requested
        return all_reduce_sum([float(requested)], self.device)[0] > 0

    def _save_or_drain(self) -> Path | None:
        """Rank 0 checkpoints; the others only drain their updates (the checkpoint needs every
        owner's) and go on to the next step's first collective, which waits for rank 0."""
        if self.ctx is None or self.ctx.main:
            return self.save()
        self.engine.drain()
        return None

    def _say(self, line: str) -> None:
        if self.log:
            print(line, flush=True)


def train(cfg: TrainConfig, *, log: bool = True) -> list[dict[str, Any]]:
    return Trainer(cfg, log=log).run()
