"""The report of ``slidedp bench train``: per-run figures, the ratios, the printed table.

A worker's raw result (step times, tokens per step, memory, lanes) becomes a run with means over
the measured steps; ``ratios`` divides our tokens/s by each baseline's and each peer's at the
same batch, where that system ran.

Example::

    run = summarise(result, peak_pss_bytes, Model(flops_per_token=f, peak_flops=p, params=n))
    print_report(report)  # report["runs"] holds such runs, report["ratios"] ratios(runs)
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

GIB = 2**30
BASELINES = ("fsdp2", "reference")


@dataclass(frozen=True)
class Model:
    """What turns a step time into FLOP/s, MFU and memory per parameter."""

    flops_per_token: float
    peak_flops: float | None  # measured bf16 GEMM peak; None on CPU
    params: int


def summarise(
    result: dict[str, Any], peak_pss_bytes: int, model: Model, world: int = 1
) -> dict[str, Any]:
    """A worker's raw result → the reported run (means over the measured steps); a run of
    ``world`` ranks has their summed tokens/s and its MFU is against ``world`` peaks."""
    run = dict(result)
    pss = max(peak_pss_bytes, int(result.get("host_pss_end_bytes", 0)))
    run["host_pss_peak_gib"] = pss / GIB
    run["host_pss_gib_per_billion_params"] = run["host_pss_peak_gib"] / (model.params / 1e9)
    reserved = result.get("gpu_peak_reserved_bytes")
    run["gpu_peak_reserved_gib"] = None if reserved is None else reserved / GIB
    if result["status"] != "ok":
        return run
    times = result["step_times_s"]
    run["step_time_s"] = sum(times) / len(times)
    run["tokens_per_s"] = result["tokens_per_step"] / run["step_time_s"]
    run["tflops"] = run["tokens_per_s"] * model.flops_per_token / 1e12
    peak = None if model.peak_flops is None else model.peak_flops * world
    run["mfu"] = None if peak is None else run["tflops"] * 1e12 / peak
    if "lanes_s" in result:  # ours: the compute lane's waits, by the lane waited on
        waits = {k: v for k, v in result["lanes_s"].items() if k.startswith("wait_")}
        run["exposed_wait_s"] = {
            k.removeprefix("wait_").removesuffix("_s"): v for k, v in waits.items()
        }
    return run


def is_ours(system: str) -> bool:
    """Ours or a variant of it (``ours:LABEL``): a numerator of the ratios, never a divisor."""
    return system == "ours" or system.startswith("ours:")


def ours_family(runs: list[dict[str, Any]]) -> list[str]:
    """The variants of ours among ``runs``, after ours itself where it has rows or no variant
    has (a report of peers alone still says ours did not run)."""
    variants = list(dict.fromkeys(r["system"] for r in runs if r["system"].startswith("ours:")))
    plain = not variants or any(r["system"] == "ours" for r in runs)
    return ["ours", *variants] if plain else variants


def compared(runs: list[dict[str, Any]]) -> list[str]:
    """The systems ours is divided by: those that ran (a row of ``runs``, whatever its
    status), the baselines first, then the peers."""
    others = list(dict.fromkeys(r["system"] for r in runs if not is_ours(r["system"])))
    return [s for s in BASELINES if s in others] + [s for s in others if s not in BASELINES]


def ratios(runs: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Per batch, tokens/s of ours (``ours_over_X``) and of each variant of ours
    (``ours:LABEL_over_X``) over each other system X (None where either did not run)."""
    by_key = {(r["batch"], r["system"]): r for r in runs}
    out = []
    for batch in sorted({r["batch"] for r in runs}):
        row: dict[str, Any] = {"batch": batch}
        for mine in ours_family(runs):
            ours = by_key.get((batch, mine), {}).get("tokens_per_s")
            for base in compared(runs):
                theirs = by_key.get((batch, base), {}).get("tokens_per_s")
                row[f"{mine}_over_{base}"] = ours / theirs if ours and theirs else None
        out.append(row)
    return out


def _fmt(value: float | None, spec: str, width: int = 0) -> str:
    return f"{'-' if value is None else format(value, spec):>{width}}"


def run_label(r: dict[str, Any]) -> str:
    """The system, and for a run of several ranks their number and ours' route."""
    if r.get("world", 1) == 1:
        return str(r["system"])
    return f"{r['system']} x{r['world']}" + (f" {r['route']}" if r.get("route") else "")


def _run_line(r: dict[str, Any], width: int) -> str:
    head = f"{r['batch']:>5} {run_label(r):<{width}}"
    if r["status"] != "ok":
        label = "OOM" if r["status"] == "oom" else r["status"].upper()
        return f"{head} {label:>10}  {r.get('error', '')}"
    return (
        f"{head} {r['tokens_per_s']:>10.1f} {r['step_time_s'] * 1e3:>9.1f} {r['tflops']:>8.2f} "
        f"{_fmt(r['mfu'], '.1%', 6)} {_fmt(r['gpu_peak_reserved_gib'], '.2f', 8)} "
        f"{r['host_pss_peak_gib']:>9.2f}"
    )


def print_report(report: dict[str, Any]) -> None:
    peak, model = report["peak_flops"], report["model"]
    print(
        f"slidedp bench train: {report['shape']} ({model['layers']} layers, "
        f"{model['params'] / 1e9:.2f}B params), S={report['seq_len']}, "
        f"{report['warmup_steps']} warm-up + {report['steps']} measured steps, "
        f"{report['device_name']}"
        + (f" (bf16 GEMM peak {peak / 1e12:.0f} TFLOP/s)" if peak else "")
    )
    print(f"model FLOPs/token {report['flops_per_token']:.4g} = {report['flops_formula']}")
    limits = [
        f"{what} {report[key]:g} GiB"
        for what, key in (("GPU", "gpu_limit_gib"), ("host", "host_limit_gib"))
        if report.get(key)
    ]
    if limits:
        print(f"limits (a smaller machine than this one): {', '.join(limits)}")
    width = max([10, *(len(run_label(r)) for r in report["runs"])])
    print(
        f"{'batch':>5} {'system':<{width}} {'tokens/s':>10} {'step ms':>9} {'TFLOP/s':>8} "
        f"{'MFU':>6} {'GPU GiB':>8} {'host GiB':>9}"
    )
    for r in report["runs"]:
        print(_run_line(r, width))
        if "exposed_wait_s" in r:
            waits = ", ".join(f"{k} {v * 1e3:.1f}" for k, v in r["exposed_wait_s"].items())
            print(f"{'':{width + 6}} exposed wait, ms/step: {waits}")
        if r.get("seq_len", report["seq_len"]) != report["seq_len"]:  # the reference's S'
            print(f"{'':{width + 6}} at S={r['seq_len']}, not --seq")
        if "kernels" in r:
            print(f"{'':{width + 6}} layer compute: {r['kernels']}")
        if "startup_s" in r:
            s = r["startup_s"]
            print(
                f"{'':{width + 6}} to the first step {s['to_first_step_s']:.1f} s: weights "
                f"{s['fill_state_s']:.1f} ({r['weights']}), pinning {s['pin_s']:.1f}, first "
                f"step {s['first_step_s']:.1f}"
            )
        if "policy" in r:  # runtime.policy=auto: what it chose
            print(f"{'':{width + 6}} {r['policy']}")
        if r.get("gpu_alloc_retries"):  # at the edge of the device's memory
            print(f"{'':{width + 6}} allocator retries: {r['gpu_alloc_retries']} (cache freed)")
    one = ""  # with --gpus/--ranks: these are the ratios on one
    if "world" in report:
        one = " on 1 GPU" if report["device"] == "cuda" else " on 1 rank"
    for row in report["ratios"]:
        parts = [f"{k.replace('_over_', '/', 1)} {_fmt(v, '.2f')}x" for k, v in row.items()
                 if k != "batch"]  # fmt: skip
        print(f"ratios at batch {row['batch']}{one} (tokens/s): {', '.join(parts)}")
