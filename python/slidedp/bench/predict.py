"""``slidedp bench train --predict``: the step-time model's prediction of every run of ours in
the report, calibrated on this machine in the same command, beside the measured step.

Calibration, each probe in its own child process after the runs (cached like ``slidedp
profile``): the layer's forward and backward per layer policy (``profile.layer``), the host
AdamW and cast rates under the GPU's copies (``profile.host``; a run of R ranks: its R pools
at once too), on several ranks the same command's collectives (``bench.collectives``). The
head, embedding and copies are assumed as
``plan.timing`` says; the prediction is ``plan.timing.spec_from_shapes`` through the Rust model,
and the error printed is predicted / measured - 1. A run that splits each sequence over R
ranks (``--context-parallel R``) is predicted per rank at S/R tokens with its exchanges, from
FLOPs (``spec_from_shapes``): no layer probe of the whole sequence on one GPU.

Example::

    predictions = predict_report(report, Path(tmp))   # tmp: the bench's model config dir
    print_predictions(predictions)
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import subprocess
import sys
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from slidedp.bench.provenance import write_report
from slidedp.cli_args import positive, writable
from slidedp.config_runtime import RUNTIME_GROUP_OF, RuntimeSection
from slidedp.errors import ConfigError
from slidedp.estimate import launch_context
from slidedp.kernels import default_threads
from slidedp.models.hf import HFAdapter
from slidedp.models.shapes import SHAPES, cut_layers, resolve_shape
from slidedp.plan.cost import layer_footprint
from slidedp.plan.machine import gpu_peak
from slidedp.plan.policy import Policy, resolve_policy
from slidedp.plan.step_spec import predict_step
from slidedp.plan.timing import Links, Ranks, Rates, layer_times, spec_from_shapes
from slidedp.profile.host import (
    alone_gbps,
    engine_update_threads,
    model_gbps,
    pool_gbps,
    probe_host,
)
from slidedp.profile.layer import ProfileSpec, profile_layer
from slidedp.runtime.zygote import start_child

if TYPE_CHECKING:
    from slidedp.config_runtime import RuntimeSection
    from slidedp.plan.timing import Links

PROBE_TIMEOUT_S = 300


def _probe(kind: str, args: dict[str, Any], out: Path) -> dict[str, Any]:
    """The ``kind`` probe (``PROBES``) with ``args`` in a child process; its report."""
    stderr_path = out.with_name(f"{out.name}.stderr")
    # files, not pipes: the probe never blocks on them; what it prints is not its report
    with stderr_path.open("w") as stderr, open(os.devnull, "w") as stdout:
        probe = start_child("slidedp.bench.predict", [kind, json.dumps(args), str(out)],
                            dict(os.environ), stdio=(None, stdout, stderr))  # fmt: skip
        try:
            code = probe.wait(PROBE_TIMEOUT_S)
        except subprocess.TimeoutExpired:
            probe.kill()
            probe.wait()
            past = f"ran past {PROBE_TIMEOUT_S} s"
            raise ConfigError(f"the {kind} probe for --predict {past}") from None
    if code != 0:
        tail = (stderr_path.read_text().strip().splitlines() or ["no output"])[-1]
        raise ConfigError(f"the {kind} probe for --predict failed: {tail}")
    report: dict[str, Any] = json.loads(out.read_text())
    return report


def _layer(args: dict[str, Any]) -> dict[str, Any]:
    """``profile.layer.profile_layer`` with ``args`` (the run's layer compute too)."""

    return profile_layer(ProfileSpec(**args))


def _host(args: dict[str, Any]) -> dict[str, Any]:
    """``profile.host.probe_host`` with the engine's update threads on ``args["device"]``,
    for ``args["ranks"]`` ranks of the node (their pools too)."""

    device = torch.device(args["device"])
    threads = engine_update_threads(default_threads(), device.type == "cuda")
    return probe_host(threads, device, ranks=args["ranks"])


PROBES = {"layer": _layer, "host": _host}


def _ours_runtime(report: dict[str, Any], run: dict[str, Any]) -> RuntimeSection:
    """The run's ``RuntimeSection``: the report's config of ours with the run's routes."""

    known = set(RUNTIME_GROUP_OF)
    given = {k: v for k, v in report["ours_config"]["runtime"].items() if k in known}
    route = run.get("chosen_route") or run.get("route")  # --routes auto: what auto chose
    if route:
        given["param_route"], given["grad_route"] = route.split("/")
    if "policy" in run and "layout" in run:  # runtime.policy=auto ran: the layout it chose
        given |= {"policy": "", "layers": run["layout"],
                  "resident_layers": run.get("resident_layers", 0),
                  "resident_embeddings": run.get("resident_embeddings", False)}  # fmt: skip
    if run.get("world", 1) > 1:
        given["gpus"] = run["world"]
        # --context-parallel R: every run of several ranks split each row over R of them
        given["context_parallel"] = report.get("context_parallel", {}).get("size", 1)
    return RuntimeSection.from_keys(**given)


def _links(report: dict[str, Any]) -> Links:
    """The collectives' rates from the same command; the copies at ``plan.timing``'s PCIe
    ceilings (the host probe's joint copy rates are paced by its AdamW passes, not a copy
    engine's capacity)."""

    rates: dict[str, float] = {}
    rows = report.get("collectives", {}).get("rows", [])
    for row in rows:
        if row["size"] == "layer" and row["op"] in ("reduce", "all_gather"):
            rates[f"{row['op'].removeprefix('all_')}_gbps"] = row["algbw_gbps"]
    return Links(**rates, source="measured" if rates else "assumed")


Probe = Callable[[str, dict[str, Any], Path], dict[str, Any]]


def _layer_profile(
    probe: Probe,
    config_dir: Path,
    run: dict[str, Any],
    rt: RuntimeSection,
    policy: Policy,
    seq_len: int,
    device: str,
) -> dict[str, Any]:
    """The layer profile of ``run``'s layer policies at its batch and ``seq_len`` (``probe``)."""
    families = ",".join(sorted({p.name for p in policy.layers}))
    ratios = ",".join(sorted({f"{p.ratio:g}" for p in policy.layers}))
    profile_args = {
        "shape": str(config_dir / "config.json"), "batch": run["batch"], "seq_len": seq_len,
        "families": families, "ratios": ratios,
        "device": device, "dtype": "bfloat16" if device == "cuda" else "float32",
        "warmup": 2, "steps": 5, "cache_dir": None, "force": False,
        "layer_kernels": rt.layout.kernels, "layer_compile": rt.layout.compile,
        "world": run.get("world", 1),
    }  # fmt: skip
    return probe(
        "layer", profile_args, config_dir / f"layer-b{run['batch']}-{families}-{ratios}.json"
    )


def predict_report(
    report: dict[str, Any], config_dir: Path, probe: Probe = _probe
) -> list[dict[str, Any]]:
    """The prediction of each finished run of ours (``config_dir``: the bench's model;
    ``probe``: measures here, or reads earlier probes: ``main``)."""

    runs = [r for r in report["runs"] if r["system"] == "ours" and r["status"] == "ok"]
    if not runs:
        return []
    device = report["device"]
    adapter = HFAdapter.from_dir(config_dir)
    hosts = {  # per rank count: a run of R ranks updates on R pools at once
        w: probe("host", {"device": device, "ranks": w}, config_dir / f"host-r{w}.json")
        for w in sorted({r.get("world", 1) for r in runs})
    }
    # the layer efficiency of plan.timing is a share of the dense bf16 peak of the GPU's kind
    peak = gpu_peak(report["device_name"])[0] or report["peak_flops"] or 1e12
    links = _links(report)
    clipping = float(report["ours_config"]["train"]["max_grad_norm"]) > 0
    dtype = torch.bfloat16 if device == "cuda" else torch.float32
    out = []
    for run in runs:
        rt = _ours_runtime(report, run)
        policy = resolve_policy(
            rt, adapter, mirror=bool(run["mirror"]), device=torch.device(device)
        )
        seq_len, context = run.get("seq_len", report["seq_len"]), launch_context(rt.launch, adapter)
        r, scheme = (context.size, context.scheme) if context else (1, "ulysses")
        # at R > 1 the model prices each rank's S/R tokens by FLOPs (spec_from_shapes): no
        # profile of the whole sequence on one GPU, which is what R ranks are there to avoid
        measured = {}
        if context is None:
            measured = layer_times(
                _layer_profile(probe, config_dir, run, rt, policy, seq_len, device)
            )
        offloaded = [  # a rank's S/R tokens, attention's as the scheme's worst rank's
            layer_footprint(adapter, p, run["batch"], seq_len // r, dtype, i,
                            context=context).offloaded_bytes
            for i, p in enumerate(policy.layers)
        ]  # fmt: skip
        ranks = Ranks(run.get("world", 1), policy.grad_route, policy.param_route, r, scheme)
        host = hosts[ranks.count]
        spec = spec_from_shapes(
            adapter, policy, batch=run["batch"], seq_len=seq_len,
            rates=Rates(peak, model_gbps(host), host.get("joint_cast_gbps"), links, measured,
                        adamw_alone_gbps=alone_gbps(host), pool_gbps=pool_gbps(host)),
            clipping=clipping, offloaded_bytes=offloaded, ranks=ranks,
        )  # fmt: skip
        predicted = predict_step(spec)
        out.append({
            "batch": run["batch"], "world": run.get("world", 1), "route": run.get("route"),
            "context_parallel": r, "context_attention": scheme if r > 1 else None,
            "measured_step_s": run["step_time_s"], "predicted_step_s": predicted.step_s,
            "error": predicted.step_s / run["step_time_s"] - 1,
            "measured_exposed_s": run.get("exposed_wait_s", {}),
            "predicted_exposed_s": predicted.exposed_s,
            "regime": regime_on(predicted.regime, report["device"]),
            "adamw_gbps": model_gbps(host), "links": dataclasses.asdict(links),
        })  # fmt: skip
    return out


def print_predictions(rows: list[dict[str, Any]], calibration: str = "here") -> None:
    if not rows:
        return
    print(f"step-time model (calibrated {calibration}: layer profile, host probe, collectives):")
    print(f"{'batch':>5} {'ranks':>5} {'route':<20} {'measured':>9} {'model':>8} {'error':>7}  "
          "exposed waits measured | model")  # fmt: skip
    for r in rows:
        measured, model = (_waits(r[k]) for k in ("measured_exposed_s", "predicted_exposed_s"))
        route = (r["route"] or "-") + (
            f" cp{r['context_parallel']}" if r.get("context_parallel", 1) > 1 else ""
        )
        print(f"{r['batch']:5d} {r['world']:5d} {route:<20} "
              f"{r['measured_step_s']:8.3f}s {r['predicted_step_s']:7.3f}s {r['error']:+7.1%}  "
              f"{measured} | {model} ms; {r['regime']}")  # fmt: skip


def regime_on(regime: str, device: str | None) -> str:
    """The model's regime as it reads on ``device`` (None: not known): its "GPU-bound" means
    the compute lane is busy most of the step, which on a CPU run is the CPU's compute."""
    return regime if device == "cuda" else regime.replace("GPU-bound", "compute-bound")


def _waits(exposed: dict[str, float]) -> str:
    """The exposed waits of 5 ms or more, in ms."""
    return ", ".join(f"{k} {v * 1e3:.0f}" for k, v in exposed.items() if v >= 5e-3) or "-"


LAYER_KEYS = ("model_type", "hidden_size", "intermediate_size", "num_attention_heads",
              "num_key_value_heads", "head_dim")  # fmt: skip


def _layer_of(shape: Any) -> tuple[Any, ...]:
    """What fixes a decoder layer's time: from a shape name or a profile's config dict."""

    if isinstance(shape, str):
        if shape not in SHAPES and not Path(shape).exists():
            return ()
        shape = resolve_shape(shape).to_dict()
    return tuple(shape.get(k) for k in LAYER_KEYS) if isinstance(shape, dict) else ()


def _from_files(probes: Path, layer: tuple[Any, ...], host_gbps: float | None) -> Probe:
    """Reads the probes ``predict_report`` asks for from ``probes`` (reports of ``slidedp
    profile layer --json`` / ``profile host --json`` or of this module's children); a layer
    profile counts where its layer (``_layer_of``) is ``layer``."""
    reports: list[dict[str, Any]] = []
    for path in sorted(probes.glob("*.json")):
        try:
            reports.append(json.loads(path.read_text()))
        except (OSError, json.JSONDecodeError) as e:
            raise ConfigError(f"cannot read the probe {path}: {e}") from None
        if not isinstance(reports[-1], dict):
            raise ConfigError(
                f"{path} in --probes is not a probe (a JSON object of `slidedp profile layer "
                "--json` or `profile host --json`): move it out of the folder"
            )

    def probe(kind: str, args: dict[str, Any], _out: Path) -> dict[str, Any]:
        if kind == "host":
            if host_gbps:
                return {"adamw_gbps": host_gbps}
            found = [r for r in reports if "adamw_gbps" in r]
            if not found:
                raise ConfigError(f"no host probe in {probes}: add one or give --host-gbps")
            # the run's ranks' pools where probed (else the node's rate shared among them)
            probed = [r for r in found if r.get("ranks", 1) == args["ranks"]]
            return (probed or found)[-1]
        wanted = set(args["families"].split(","))
        for r in reports:
            names = {c["policy"].rsplit("-r", 1)[0] for c in r.get("candidates", [])}
            at = (r.get("batch"), r.get("seq_len")) == (args["batch"], args["seq_len"])
            if at and wanted <= names and _layer_of(r.get("shape")) == layer:
                return r
        raise ConfigError(
            f"no layer profile of this model's layer at batch {args['batch']} x "
            f"{args['seq_len']} with {args['families']} in {probes}"
        )

    return probe


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("report", help="a `slidedp bench train --json` report")
    parser.add_argument("--probes", required=True, help="a folder of layer and host probes")
    parser.add_argument(
        "--host-gbps", type=positive, default=None, help="the host AdamW rate, instead of a probe"
    )
    parser.add_argument("--json", help="also write the predictions and this run's facts here")


def main(args: argparse.Namespace) -> int:
    """``slidedp bench predict REPORT --probes DIR``: ``--predict`` for a report measured
    earlier, from probes run apart (on the same machine kind)."""

    writable("--json", args.json)
    try:
        report = json.loads(Path(args.report).read_text())
    except (OSError, json.JSONDecodeError) as e:
        raise ConfigError(f"cannot read the report {args.report}: {e}") from None
    config = resolve_shape(report["shape"])
    if int(config.num_hidden_layers) != report["model"]["layers"]:
        config = cut_layers(config, report["model"]["layers"])
    probe = _from_files(Path(args.probes), _layer_of(config.to_dict()), args.host_gbps)
    with tempfile.TemporaryDirectory(prefix="slidedp-predict-") as tmp:
        config.to_json_file(Path(tmp) / "config.json")
        rows = predict_report(report, Path(tmp), probe)
    print_predictions(rows, f"from {args.probes}")
    write_report(args.json, rows)
    return 0


if __name__ == "__main__":  # a probe's child: KIND ARGS_JSON OUT
    if len(sys.argv) != 4 or sys.argv[1] not in PROBES:
        sys.exit(f"usage: python -m slidedp.bench.predict {{{','.join(PROBES)}}} ARGS_JSON OUT")
    report = PROBES[sys.argv[1]](json.loads(sys.argv[2]))
    Path(sys.argv[3]).write_text(json.dumps(report))
