"""``slidedp profile layer --shape qwen3-4b --batch 16 --seq-len 1024 --json F --png F``.

Runs one decoder layer of each kind of the shape (``HFAdapter.layer_kinds``) with random weights
through every candidate layout (each checkpoint family of ``--families`` at each offload ratio of
``--ratios``) with the engine's own executors and offload, and measures per candidate
``forward_s``, ``backward_s``, ``replay_s``, ``reload_s``, ``retained_bytes``,
``offloaded_bytes`` and ``transient_bytes``, beside ``plan.cost``'s ``estimated_*`` (the cost
model's error). Pareto-efficient candidates are marked (``--png`` draws them).
Invariant: the JSON, the policy solver's input, is cached (``--cache-dir``) one file per kind
under a key of every fact it depends on (device, shape, batch, sequence, dtype, world size,
candidates, layer compute, versions): a changed fact is another key, never a reuse; ``--force``
measures again. ``--kernels eager,liger,compiled,liger+compiled`` instead times the layer under
each layer-compute variant (``profile.kernels``; not cached).
"""

from __future__ import annotations

import argparse
import collections
import dataclasses
import functools
import importlib.metadata
import json
import math
import os
import statistics
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import torch
import transformers

from slidedp import __version__
from slidedp.cli_args import count, listed, ratios, writable
from slidedp.config import TrainConfig
from slidedp.errors import ConfigError
from slidedp.models.fast import COMPILE_BACKEND, Compute, apply_compute, resolve_compute
from slidedp.models.hf import HFAdapter
from slidedp.models.hf_config import apply_overrides
from slidedp.models.shapes import SHAPES, resolve_shape
from slidedp.plan.cost import layer_footprint
from slidedp.plan.device import pick_device, pick_dtype
from slidedp.plan.layout import LayerPolicy, parse_entry
from slidedp.plan.policy import check_layout_fits
from slidedp.profile.cache import cache_file, cpu_model, keep_report, read_report
from slidedp.profile.kernels import VARIANTS, format_kernels, layer_inputs, profile_kernels
from slidedp.profile.pareto import mark_pareto, plot_pareto, require_matplotlib
from slidedp.runtime.activations import LayerRun, LayerState, executor_for
from slidedp.runtime.activations.offload import ActivationOffload, offload_count
from slidedp.runtime.lanes import LaneClock, synchronize

FAMILIES = "F,S0000000,S0000100,S1010100,S1111111,SAC.mm,SAC.attn,SAC.noact,N"
RATIOS = "0,0.5,1"


@dataclass(frozen=True)
class ProfileSpec:
    """What ``profile_layer`` measures: the shape (a name of ``models.shapes`` or a
    config.json), one rank's batch, the sequence, the candidates, device and dtype, the run's
    layer compute and world size (both part of the cache key)."""

    shape: str = "qwen3-4b"
    batch: int = 16
    seq_len: int = 1024
    families: str = FAMILIES
    ratios: str = RATIOS
    device: str = "auto"
    dtype: str = "auto"
    warmup: int = 2
    steps: int = 5
    cache_dir: str | None = None  # profile.cache.default_cache_dir
    force: bool = False
    layer_kernels: str = "eager"
    layer_compile: bool | None = False
    world: int = 1  # processes the run's batch is split over
    mlp_tile_tokens: int = 0  # runtime.mlp_tile_tokens of the run (models.tiled_mlp)
    # the run's model.* overrides of the shape's config (ModelSection.config_overrides), JSON
    config_overrides: str = ""

    @classmethod
    def from_args(cls, args: argparse.Namespace) -> ProfileSpec:
        """The spec of ``slidedp profile layer``'s command line."""
        names = [f.name for f in dataclasses.fields(cls)]
        return cls(**{n: getattr(args, n) for n in names if hasattr(args, n)})


def profile_spec(cfg: TrainConfig, **given: Any) -> ProfileSpec:
    """The profile of the run's own model, batch per rank and sequence, on its device and
    dtype, with its layer compute (``runtime.kernels``, ``runtime.compile``); ``given``
    replaces any field. With ``runtime.context_parallel: R`` a rank's shard: the rows of its
    group, S/R tokens each (its activations' bytes; ``autopolicy.select`` adds the attention
    over the whole sequence and the all-to-alls to the times)."""
    launch = cfg.runtime.launch
    run = ProfileSpec(
        shape=str(Path(cfg.model.path) / "config.json"),
        batch=cfg.train.global_batch_size // launch.data_world,
        world=launch.world,
        seq_len=cfg.data.seq_len // launch.context_parallel,
        device=cfg.runtime.launch.device,
        dtype=cfg.train.dtype,
        layer_kernels=cfg.runtime.layout.kernels,
        layer_compile=cfg.runtime.layout.compile,
        mlp_tile_tokens=cfg.runtime.layout.mlp_tile_tokens,
        config_overrides=json.dumps(overrides)
        if (overrides := cfg.model.config_overrides())
        else "",
    )
    return dataclasses.replace(run, **given)


def spec_config(args: ProfileSpec) -> transformers.PretrainedConfig:
    """The config of ``args``' shape with the run's overrides applied (``HFAdapter.from_dir``
    applies the same to the run's model)."""
    config = resolve_shape(args.shape)
    if args.config_overrides:
        apply_overrides(config.get_text_config(), json.loads(args.config_overrides))
    return config


# the columns of a `slidedp profile layer --json` report's candidates the solve reads
PROFILE_COLUMNS = frozenset({
    "policy", "pareto", "forward_s", "backward_s", "reload_s", "retained_bytes",
    "estimated_retained_bytes", "offloaded_bytes", "estimated_offloaded_bytes",
    "transient_bytes", "estimated_transient_bytes"})  # fmt: skip


def read_profile_file(path: str, cfg: TrainConfig, batch: int) -> dict[str, Any]:
    """A `slidedp profile layer --json` report given by hand, checked against the run's shape."""
    try:
        report: dict[str, Any] = json.loads(Path(path).read_text())
    except (OSError, json.JSONDecodeError) as e:
        raise ConfigError(f"--profile {path}: not a readable JSON report ({e})") from None
    rows = report.get("candidates") if isinstance(report, dict) else None
    if not isinstance(rows, list) or not all(
        isinstance(r, dict) and set(r) >= PROFILE_COLUMNS for r in rows
    ):
        raise ConfigError(f"--profile {path}: not a `slidedp profile layer --json` report")
    if report.get("batch") != batch or report.get("seq_len") != cfg.data.seq_len:
        raise ConfigError(
            f"--profile {path} is of B={report.get('batch')} S={report.get('seq_len')}, "
            f"the run is B={batch} S={cfg.data.seq_len}: profile the run's own shape"
        )
    return report


@dataclass
class Candidate:
    policy: str
    family: str
    ratio: float  # as given
    offloaded_tensors: int
    forward_s: float
    backward_s: float
    reload_s: float  # the offloaded tensors' copy back, alone (0 without offload)
    replay_s: float | None
    retained_bytes: int | None  # measured on CUDA only (None on CPU)
    offloaded_bytes: int
    transient_bytes: int | None
    estimated_retained_bytes: int
    estimated_offloaded_bytes: int
    estimated_transient_bytes: int
    pareto: bool = False
    kind: int = 0  # the first layer of its kind (``HFAdapter.layer_kinds``)


def _allocated(device: torch.device) -> int:
    return int(torch.cuda.memory_allocated(device)) if device.type == "cuda" else 0


def _timed(fn: Callable[[], Any], device: torch.device) -> tuple[Any, float]:
    synchronize(device)
    start = time.perf_counter()
    out = fn()
    synchronize(device)
    return out, time.perf_counter() - start


def measure(prof: _Profiled, policy: LayerPolicy, args: ProfileSpec, layer: int = 0) -> Candidate:
    """``policy`` on decoder layer ``layer`` (a kind's first layer), with ``prof``'s model,
    device and dtype at ``args``' batch and sequence, over ``args``' warmup and timed steps."""
    adapter, device, dtype = prof.adapter, prof.device, prof.dtype
    batch, seq_len, warmup, steps = args.batch, args.seq_len, args.warmup, args.steps
    params, x, ctx = layer_inputs(adapter, batch, seq_len, device, dtype, layer)
    executor = executor_for(policy)
    offload = ActivationOffload(device, LaneClock(device))
    fwd, bwd, reload_s, retained, transient, offloaded, count = [], [], [], 0, 0, 0, 0
    try:
        for step in range(warmup + steps):
            x_in = x.clone()  # the layer's own input: it counts as retained if the family keeps it
            x_bytes = x_in.numel() * x_in.element_size()
            before = _allocated(device) - x_bytes

            def forward(x_in: torch.Tensor = x_in) -> tuple[torch.Tensor, LayerState]:
                return executor.forward(LayerRun(adapter, layer, params, ctx), x_in)

            (y, state), f_s = _timed(forward, device)
            del x_in
            count = offload_count(state.saved_bytes(), policy.ratio)
            offloaded = sum(state.saved_bytes()[:count])
            offload.offload(0, state, count)
            synchronize(device)
            retained = _allocated(device) - before - y.numel() * y.element_size()
            g = torch.ones_like(y)
            del y
            # the copy back is timed apart: the engine prefetches it under the previous layer
            _, r_s = _timed(functools.partial(offload.reload, 0, state), device)
            start = _allocated(device)
            if device.type == "cuda":
                torch.cuda.reset_peak_memory_stats(device)

            def backward(state: LayerState = state, g: torch.Tensor = g) -> Any:
                return executor.backward(LayerRun(adapter, layer, params, ctx), state, g)

            _, b_s = _timed(backward, device)
            if device.type == "cuda":
                transient = int(torch.cuda.max_memory_allocated(device)) - start
            del state, g
            if step >= warmup:
                fwd.append(f_s)
                bwd.append(b_s)
                reload_s.append(r_s)
    finally:
        offload.close()
    kernels = adapter.compute or "eager"  # the patched-in ones (and MLP tiles)
    fp = layer_footprint(adapter, policy, batch, seq_len, dtype, layer, kernels)
    return Candidate(
        policy=str(policy),
        family=policy.name,
        ratio=policy.ratio,
        offloaded_tensors=count,
        forward_s=statistics.median(fwd),
        backward_s=statistics.median(bwd),
        reload_s=statistics.median(reload_s),
        replay_s=None,
        retained_bytes=retained if device.type == "cuda" else None,
        offloaded_bytes=offloaded,
        transient_bytes=transient if device.type == "cuda" else None,
        estimated_retained_bytes=fp.retained_bytes,
        estimated_offloaded_bytes=fp.offloaded_bytes,
        estimated_transient_bytes=fp.transient_bytes,
        kind=layer,
    )


def candidates(families: str, ratios: str, adapter: HFAdapter, batch: int, seq_len: int,
               dtype: torch.dtype, layer: int = 0,
               kernels: str | Compute = "eager") -> list[LayerPolicy]:  # fmt: skip
    """Every family the model's layer takes (``check_layout_fits``: no ``S`` on a Gemma or MoE
    layer, no ``SAC.noact`` on a MoE) at every ratio, one per distinct offloaded set (ratios
    merged). A candidate's ratio is the share it really offloads (of what the layer saves with
    ``kernels``), rounded down to 1e-6 so that its text form (``runtime.layers``) selects the
    same tensors; of layer ``layer``'s kind."""
    out: list[LayerPolicy] = []
    seen: set[tuple[str, int]] = set()
    for fam in (f.strip() for f in families.split(",") if f.strip()):
        for r in (float(r) for r in ratios.split(",") if r.strip()):
            _, policy = parse_entry(f"{fam}-r{r:g}", 0.0)
            try:
                check_layout_fits((policy,), adapter)
            except ConfigError:
                continue
            fp = layer_footprint(adapter, policy, batch, seq_len, dtype, layer, kernels)
            saved = list(fp.saved)
            count = offload_count(saved, r)
            if (policy.name, count) in seen:
                continue
            seen.add((policy.name, count))
            share = sum(saved[:count]) / sum(saved) if count else 0.0  # what it really offloads
            ratio = min(1.0, math.floor(share * 1e6) / 1e6)
            out.append(dataclasses.replace(policy, ratio=ratio))
    return out


@dataclass(frozen=True)
class _Profiled:
    """What a profile of given arguments measures with, and where its report is cached."""

    adapter: HFAdapter
    device: torch.device
    dtype: torch.dtype
    compute: Compute
    facts: dict[str, Any]  # the cache key's facts, the report's first fields
    kinds: dict[int, int]  # layers per kind, by the kind's first layer
    cache_dir: str | None

    def cache(self, kind: int) -> Path:
        """Where kind ``kind``'s report is cached: the kind is part of the key."""
        return cache_file(self.cache_dir, "layer", self.facts | {"layer": kind})


def _profiled(args: ProfileSpec, adapter: HFAdapter | None = None) -> _Profiled:
    """The key names the families and ratios asked for, not the candidates they resolve to:
    those follow from the shape, batch, sequence, dtype and slidedp version, also in the key,
    so a cache lookup runs no layer (``estimate`` looks one up at every start on a GPU).
    ``adapter``: the shape's, built already (None: built here)."""
    config = spec_config(args)
    adapter = HFAdapter(config) if adapter is None else adapter
    device = pick_device(args.device)
    dtype = pick_dtype(args.dtype, device)
    # the layer compute the run uses (plan, runtime.policy: auto); the command line's: eager
    compute = resolve_compute(
        args.layer_kernels, args.layer_compile, device, adapter, args.mlp_tile_tokens
    )
    facts = {
        "gpu": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
        # the host runs the layer on CPU and launches its kernels beside a GPU
        "cpu": cpu_model(),
        "logical_cores": os.cpu_count(),
        "shape": _shape_facts(config) if args.shape not in SHAPES else args.shape,
        "batch": args.batch,
        "seq_len": args.seq_len,
        "dtype": str(dtype).removeprefix("torch."),
        "world": args.world,  # processes the run's batch is split over
        "families": args.families,
        "ratios": args.ratios,
        "compute": {"kernels": compute.kernels, "compile": compute.compile}
        | ({"mlp_tile_tokens": compute.mlp_tile_tokens} if compute.mlp_tile_tokens else {}),
        "torch": torch.__version__,
        "transformers": transformers.__version__,
        "liger_kernel": _liger_version() if compute.kernels == "liger" else None,
        "slidedp": __version__,
    }
    kinds = dict(sorted(collections.Counter(adapter.layer_kinds).items()))
    return _Profiled(adapter, device, dtype, compute, facts, kinds, args.cache_dir)


def _shape_facts(config: transformers.PretrainedConfig) -> dict[str, Any]:
    """The model config in the key, without where it was read from (``_name_or_path``): the
    same model in another directory (the bench writes one per run) is the same profile."""
    return {k: v for k, v in config.to_dict().items() if k != "_name_or_path"}


def _liger_version() -> str:
    return importlib.metadata.version("liger-kernel")


def _read_cache(cache: Path) -> dict[str, Any] | None:
    """The cached report, or None: none, or one that does not read (measured again)."""
    report = read_report(cache)
    if report is None or not isinstance(report.get("candidates"), list):
        return None
    report["cached"] = str(cache)
    return report


def _combined(prof: _Profiled, reports: dict[int, dict[str, Any]]) -> dict[str, Any]:
    """One report of every kind's: their candidates, each with its ``kind``, and the layers
    per kind (``kinds``); ``cached``: where, when every kind's was cached (None otherwise)."""
    cached = [r["cached"] for r in reports.values()]
    return prof.facts | {
        "kinds": {str(k): n for k, n in prof.kinds.items()},
        "candidates": [c | {"kind": k} for k, r in reports.items() for c in r["candidates"]],
        "cached": ", ".join(cached) if all(cached) else None,
    }


def cached_profile(args: ProfileSpec) -> dict[str, Any] | None:
    """The cached report of ``args`` (None when a kind's is not cached: nothing is measured)."""
    prof = _profiled(args)
    reports = {k: _read_cache(prof.cache(k)) for k in prof.kinds}
    if any(r is None for r in reports.values()):
        return None
    return _combined(prof, {k: r for k, r in reports.items() if r is not None})


def _measure_kind(
    prof: _Profiled, args: ProfileSpec, kind: int, policies: list[LayerPolicy]
) -> dict[str, Any]:
    """Kind ``kind``'s report: ``policies`` on its first layer, measured and cached."""
    results = [measure(prof, p, args, kind) for p in policies]
    no_replay = [c.backward_s for c in results if c.family == "N" and c.ratio == 0]
    for c in results:
        c.replay_s = c.backward_s - no_replay[0] if no_replay else None
    mark_pareto(results)
    measured: dict[str, Any] = prof.facts | {
        "layer": kind,
        "candidates": [asdict(c) for c in results],
        "cached": None,
    }
    keep_report(prof.cache(kind), measured)
    return measured


def warm_kernels(args: ProfileSpec, adapter: HFAdapter) -> None:
    """One forward and backward of each layer kind's first layer under ``F`` (its forward
    without and its replay with autograd: both grad modes), with the run's layer compute at
    its batch and sequence: every kernel the engine's layers launch is compiled (into Triton's
    and Inductor's caches on disk). Nothing is timed or cached here. ``adapter``: a fresh one
    of ``args``' shape (``HFAdapter(spec_config(args))``), patched here; built by the
    caller, as transformers sets torch's process-wide default dtype while it builds a model."""
    prof = _profiled(args, adapter)
    apply_compute(prof.adapter, prof.compute)
    _, policy = parse_entry("F", 0.0)
    once = dataclasses.replace(args, warmup=0, steps=1)
    for kind in prof.kinds:
        measure(prof, policy, once, kind)


def profile_layer(args: ProfileSpec) -> dict[str, Any]:
    """Every kind's candidates (``_combined``): each kind's cached report, or measured once."""
    prof = _profiled(args)
    reports = {k: None if args.force else _read_cache(prof.cache(k)) for k in prof.kinds}
    todo = {k: candidates(args.families, args.ratios, prof.adapter, args.batch, args.seq_len,
                          prof.dtype, k, prof.compute)
            for k, r in reports.items() if r is None}  # fmt: skip
    if todo:
        apply_compute(prof.adapter, prof.compute)  # after the candidates: the cost model on meta
    done = {k: _measure_kind(prof, args, k, policies) for k, policies in todo.items()}
    return _combined(prof, {k: r or done[k] for k, r in reports.items()})


def _gib(n: int | None) -> str:
    return "-" if n is None else f"{n / 2**30:.3f}G"


def format_report(report: dict[str, Any]) -> str:
    shape = report["shape"] if isinstance(report["shape"], str) else "config"
    cached = f" (cached: {report['cached']})" if report["cached"] else ""
    lines = [
        f"slidedp profile layer: {shape}, B={report['batch']} x S={report['seq_len']}, "
        f"{report['dtype']} on {report['gpu']}{cached}",
        f"  {'candidate':<20} {'fwd ms':>8} {'bwd ms':>8} {'replay':>8} {'reload':>8} "
        f"{'retained':>9} {'(est.)':>8} {'offload':>8} {'(est.)':>8} {'backward':>9} "
        f"{'(est.)':>8}  pareto",
    ]
    kinds = len(report.get("kinds") or {"0": 1})
    for c in report["candidates"]:
        # several kinds: each candidate named with its kind's first layer
        name = c["policy"] if kinds == 1 else f"layer {c.get('kind', 0)}: {c['policy']}"
        replay = "" if c["replay_s"] is None else f"{c['replay_s'] * 1e3:.2f}"
        memory = (
            f"{_gib(c['retained_bytes']):>9} {_gib(c['estimated_retained_bytes']):>8} "
            f"{_gib(c['offloaded_bytes']):>8} {_gib(c['estimated_offloaded_bytes']):>8} "
            f"{_gib(c['transient_bytes']):>9} {_gib(c['estimated_transient_bytes']):>8}"
        )
        lines.append(
            f"  {name:<20} {c['forward_s'] * 1e3:8.2f} {c['backward_s'] * 1e3:8.2f} "
            f"{replay:>8} {c['reload_s'] * 1e3:8.2f} {memory}  {'*' if c['pareto'] else ''}"
        )
    return "\n".join(lines)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--shape", default="qwen3-4b", help=f"{', '.join(SHAPES)} or a config.json")
    parser.add_argument("--batch", type=count(1), default=16, help="sequences per step")
    parser.add_argument("--seq-len", type=count(2), default=1024)
    parser.add_argument("--families", default=FAMILIES, help="comma-separated checkpoint families")
    parser.add_argument(
        "--ratios", type=ratios, default=RATIOS, help="comma-separated offload ratios"
    )
    parser.add_argument("--device", default="auto", choices=("auto", "cpu", "cuda"))
    parser.add_argument("--dtype", default="auto", choices=("auto", "float32", "bfloat16"))
    parser.add_argument("--warmup", type=count(0), default=2)
    parser.add_argument("--steps", type=count(1), default=5)
    parser.add_argument("--json", help="write the report here")
    parser.add_argument("--png", help="draw the memory-time Pareto frontier here")
    parser.add_argument(
        "--cache-dir", default=None, help="default: $XDG_CACHE_HOME/slidedp/profile"
    )
    parser.add_argument("--force", action="store_true", help="measure even if cached")
    parser.add_argument(
        "--kernels",
        type=listed(VARIANTS),
        default="",
        help="instead of the layouts: these layer-compute variants with their kernel breakdown "
        f"(comma-separated: {','.join(VARIANTS)})",
    )
    parser.add_argument("--top", type=count(1), default=12, help="kernels shown per variant")
    parser.add_argument("--backend", default=COMPILE_BACKEND, help="torch.compile backend")


def main(args: argparse.Namespace) -> int:
    if args.png:
        require_matplotlib()  # before measuring
    writable("--json", args.json)
    writable("--png", args.png)
    limit = getattr(resolve_shape(args.shape).get_text_config(), "max_position_embeddings", None)
    if limit is not None and args.seq_len > limit:
        raise ConfigError(
            f"--seq-len {args.seq_len} exceeds the model's max_position_embeddings={limit}; "
            "lower --seq-len"
        )
    if args.kernels:
        report = profile_kernels(args)
        print(format_kernels(report))
    else:
        report = profile_layer(ProfileSpec.from_args(args))
        print(format_report(report))
    if args.json:
        Path(args.json).write_text(json.dumps(report, indent=1))
    if args.png and not args.kernels:
        plot_pareto(report, Path(args.png))
    return 0
