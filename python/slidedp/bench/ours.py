"""Our engine in the benchmark: ``Trainer(cfg, log=False).run()`` on synthetic tokens.

The parent passes our whole resolved training config (``RunSpec.ours``, ``--set`` overrides
applied and validated); this sets what the bench owns — model config, data (the same synthetic
tokens as the baselines, as JSONL), output, steps, batch, device — and reads the step times and
lane times from the per-step records. On several ranks (``spec.world``, launched by
``bench.ranks``) their launcher decides the plan (``plan_for_ranks``) and each rank builds
the trainer with it, which joins them (``Dist.from_env``); the global batch is ``world x
batch``, rank 0's records are the result and each rank traces into its own file (``-rankR``).
``startup_s`` is the time to the first step, broken down (``startup``).

Example::

    result = run_ours(spec)  # a RunSpec with system="ours"
"""

from __future__ import annotations

import copy
import dataclasses
import json
import tempfile
from pathlib import Path
from typing import Any

from transformers import AutoConfig

from slidedp.autopolicy.auto import resolve_auto
from slidedp.bench.measure import RunSpec, synthetic_tokens
from slidedp.config import TrainConfig, config_from_dict
from slidedp.plan.machine import Machine
from slidedp.plan.policy import Plan, read_plan
from slidedp.plan.resolve import resolve_plan
from slidedp.preflight import check_model
from slidedp.runtime.dist import Dist
from slidedp.runtime.lanes import LANES, WAITS
from slidedp.runtime.startup import PARTS
from slidedp.runtime.trainer import Trainer
from slidedp.runtime.zygote import process_age_s


class _BenchTrainer(Trainer):
    """The trainer without its final checkpoint: the bench measures steps, and a checkpoint
    of the whole host state (12 bytes per parameter: 48 GB for Qwen3-4B) would only fill the
    disk. Saving still drains the update lane, as ``Trainer.save`` does first."""

    def save(self) -> Path:
        self.engine.drain()
        return self.out_dir


def startup(
    stamps: dict[str, float], trainer: _BenchTrainer, first_step_s: float
) -> dict[str, float]:
    """The time to the first step of one run, in its parts (seconds): the process until the
    run starts (interpreter, imports, tokens written; a worker forked from the bench's zygote
    counts the zygote's imports as its own, ``process_age_s``), the config (with ``runtime.policy:
    auto``: its choice), the trainer's build (``trainer_init_s``: the parts its
    ``StartupClock`` timed, ``store_create_s``, ``fill_state_s``, ``mirror_s``, ``data_s``,
    ``engine_s``, ``kernels_s`` the wait for the kernel warm-up once the store is built; of
    the engine ``pin_s`` and the GPU-resident groups' state loaded, ``resident_load_s``;
    ``other_init_s`` the rest of the build; ``kernel_warmup_s`` the warm-up's own time on its
    thread, beside the build), the first step (what compiles in it included; ``arena_s`` of
    it: the activation offload arenas allocated and
    page-locked) and the sum, ``to_first_step_s``. A rank that attached to the store its node's
    first rank made has no store parts: the bench reports rank 0, which made it."""
    init, engine, clock = stamps["trainer"] - stamps["config"], trainer.engine, trainer.startup
    built = {k: clock.parts.get(k, 0.0) for k in PARTS}
    parts = {
        "process_s": stamps["start"],
        "config_s": stamps["config"] - stamps["start"],
        "trainer_init_s": init,
        **built,
        "pin_s": engine.pin_s,
        "resident_load_s": engine.resident_s,
        "other_init_s": init - sum(built.values()),
        "kernel_warmup_s": clock.warmup_s or 0.0,
        "first_step_s": first_step_s,
        "arena_s": engine.activations.arena_s,
        "to_first_step_s": stamps["trainer"] + first_step_s,
    }
    return {k: round(v, 3) for k, v in parts.items()}


def ours_raw_config(spec: RunSpec, data: Path, out: Path) -> dict[str, Any]:
    """``spec.ours`` (a resolved config) with the keys the bench owns set for this run."""
    raw = copy.deepcopy(spec.ours)
    raw["model"]["path"] = spec.weights_dir or spec.config_dir
    raw["data"].update(path=str(data), seq_len=spec.seq_len)
    raw["output"].update(dir=str(out), export=False)
    raw["train"].update(max_steps=spec.warmup + spec.steps, global_batch_size=spec.global_batch)
    raw["runtime"]["device"] = spec.device
    if spec.world > 1:
        raw["runtime"]["gpus" if spec.device == "cuda" else "ranks"] = spec.world
        ctx = Dist.from_env()
        if ctx is not None and raw["runtime"]["trace_path"]:  # one trace file per rank
            trace = Path(raw["runtime"]["trace_path"])
            name = f"{trace.stem}-rank{ctx.rank}{trace.suffix}"
            raw["runtime"]["trace_path"] = str(trace.with_name(name))
    return raw


def resolved_config(spec: RunSpec, data: Path, out: Path) -> tuple[TrainConfig, str | None]:
    """Our config for this run; with ``runtime.policy=auto`` the layout chosen (and the layer
    profiled, when not cached) before any timed step, and the line that says so. A rank of
    several takes its launcher's plan instead (``rank_config``)."""
    cfg = config_from_dict(ours_raw_config(spec, data, out))
    machine = Machine.probe(cfg, measure=False)
    fixed = None if spec.auto_routes else True  # --routes auto, or the route the bench set
    return resolve_auto(cfg, check_model(cfg)[0], machine, measure=True, routes_fixed=fixed)


def rank_config(spec: RunSpec, data: Path, out: Path) -> tuple[TrainConfig, Plan]:
    """A rank's config and the plan it runs: its launcher's (``spec.plan_file``, written by
    ``plan_for_ranks``), its policy set as the config's ``runtime`` keys (as ``slidedp train
    --plan`` does), nothing chosen again."""
    plan = read_plan(Path(spec.plan_file))
    cfg = config_from_dict(ours_raw_config(spec, data, out))
    return dataclasses.replace(cfg, runtime=cfg.runtime.with_keys(**plan.runtime_keys())), plan


def plan_for_ranks(spec: RunSpec, spec_path: Path) -> tuple[Path, dict[str, Any]]:
    """In the launcher of ``spec``'s ranks: the run's plan decided once (``runtime.policy=auto``
    chosen, its measurements in a child process, ``autopolicy.measure``; ``resolve_plan``),
    written as JSON beside ``spec_path`` and named in a copy of the spec the ranks read; and
    the result's keys that say what auto chose (none without ``auto``)."""
    with tempfile.TemporaryDirectory(prefix="slidedp-bench-") as tmp:
        cfg, line = resolved_config(spec, Path(tmp) / "tokens.jsonl", Path(tmp) / "out")
    plan = resolve_plan(cfg, check_model(cfg)[0], Machine.probe(cfg, measure=False))
    plan_path = spec_path.with_name(f"{spec_path.stem}.plan.json")
    plan_path.write_text(json.dumps(plan.to_json(), indent=1))
    path = spec_path.with_name(f"{spec_path.stem}.ranks.json")
    path.write_text(json.dumps(dataclasses.replace(spec, plan_file=str(plan_path)).to_json()))
    if line is None:
        return path, {}
    routes = f"{plan.policy.param_route}/{plan.policy.grad_route}"
    return path, {"policy": line, "chosen_route": routes}


def auto_layout(spec: RunSpec) -> str:
    """The layout ``runtime.policy=auto`` chooses for ``spec`` (the reference runs it too)."""
    with tempfile.TemporaryDirectory(prefix="slidedp-bench-") as tmp:
        cfg, _ = resolved_config(spec, Path(tmp) / "tokens.jsonl", Path(tmp) / "out")
        return cfg.runtime.layout.layers


def write_tokens(path: Path, spec: RunSpec, vocab_size: int) -> None:
    """The synthetic batches as JSONL, one sequence per line, in step order."""
    steps = spec.warmup + spec.steps
    tokens = synthetic_tokens(vocab_size, spec.global_batch, spec.seq_len, steps, spec.seed)
    rows = tokens.reshape(steps * spec.global_batch, spec.seq_len).tolist()
    path.write_text("".join(json.dumps({"input_ids": row}) + "\n" for row in rows))


def run_ours(spec: RunSpec) -> dict[str, Any]:
    """Timed steps of our engine (rank 0's on several ranks; the others return ``{}``); lane
    busy times and exposed waits averaged over them."""
    vocab_size = int(AutoConfig.from_pretrained(spec.config_dir).vocab_size)
    with tempfile.TemporaryDirectory(prefix="slidedp-bench-") as tmp:
        data = Path(tmp) / "tokens.jsonl"
        write_tokens(data, spec, vocab_size)
        stamps = {"start": process_age_s()}
        plan: Plan | None = None
        if spec.plan_file:  # a rank of several: its launcher's plan
            cfg, plan = rank_config(spec, data, Path(tmp) / "out")
            chosen = None
        else:
            cfg, chosen = resolved_config(spec, data, Path(tmp) / "out")
        stamps["config"] = process_age_s()
        trainer = _BenchTrainer(cfg, plan, log=False)
        stamps["trainer"] = process_age_s()
        every = trainer.run()
        records = every[spec.warmup :]
    if not records:  # a rank other than 0: rank 0 reports
        return {}
    lane_keys = [f"{k}_s" for k in LANES + WAITS]
    return {
        "startup_s": startup(stamps, trainer, every[0]["step_time_s"]),
        "weights": trainer.source,  # loaded from safetensors or initialised from the config
        "startup_notes": trainer.startup.notes,  # a warm-up that failed, as the banner says
        "step_times_s": [r["step_time_s"] for r in records],
        "tokens_per_step": records[0]["tokens"],
        "losses": [r["loss"] for r in records],
        "lanes_s": {k: sum(r[k] for r in records) / len(records) for k in lane_keys},
        "kernels": trainer.policy.compute.describe(),
        "layout": trainer.policy.layout,
        "resident_layers": trainer.policy.resident_layers,
        "resident_embeddings": trainer.policy.resident_embeddings,
        "mirror": trainer.policy.mirror,
        "update_threads": trainer.engine.kernels.threads,  # the host kernels' threads per rank
        **({"policy": chosen} if chosen else {}),
    }
