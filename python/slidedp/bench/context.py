"""``slidedp bench train --context-parallel R``: ours splits every sequence over R of the
``--gpus N`` ranks (``runtime.context_parallel``); the compute-only reference is projected by
FLOP/s.

Run (on a machine with 4 GPUs)::

    slidedp bench train --shape qwen3-8b --seq 262144 --batch 1 --gpus 4 --context-parallel 4 \\
        --systems ours,reference --no-collectives --json cp.json

Ours runs on the N ranks only (one GPU is what it splits), each of the N/R groups reading
``--batch`` rows: B x S x N/R tokens a step. Every run of ours and the reference use the keys
context parallelism is checked with (``CONTEXT_KEYS``, reported). The reference runs on one
GPU at S; where S does not fit, at the longest of S/2, S/4, ... that does (or at ``--ref-seq``).
Its N-GPU figure is N x its FLOP/s over the FLOPs per token at S, both counted with attention's
quadratic term (``runtime.flops``): at S' = S, N x its tokens/s.
"""

from __future__ import annotations

import argparse
import dataclasses
from dataclasses import dataclass
from typing import Any

from slidedp.autopolicy.auto import AUTO
from slidedp.bench.multi import AUTO_ROUTE, Scale
from slidedp.bench.report import Model
from slidedp.config import config_from_dict
from slidedp.errors import ConfigError
from slidedp.models.hf import HFAdapter
from slidedp.runtime.context_parallel import check_context
from slidedp.runtime.flops import model_flops_per_token

# what the context-parallel runs are checked with (runtime.context_parallel's preflight
# refuses the others): set on every run of ours and on the reference, which runs ours' layers
CONTEXT_KEYS: dict[str, Any] = {"kernels": "eager", "compile": False, "policy": "fixed"}
MIN_REFERENCE_SEQ = 2  # the shortest length the reference is tried at when S does not fit


def add_arguments(parser: argparse.ArgumentParser) -> None:
    arg = parser.add_argument
    arg(
        "--context-parallel",
        type=int,
        default=None,
        metavar="R",
        help="with --gpus/--ranks N: ours splits every sequence over R ranks "
        "(runtime.context_parallel=R; R divides N), the reference projected by FLOP/s",
    )
    arg(
        "--ref-seq",
        type=int,
        default=None,
        metavar="S",
        help="with --context-parallel: measure the reference at S tokens (default --seq, or "
        "where it does not fit one GPU the longest of seq/2, seq/4, ... that does)",
    )


@dataclass(frozen=True)
class ContextBench:
    """The context-parallel part of one bench: R, the reference's lengths, the model."""

    size: int  # R: ranks that split each row
    seq: int  # S: --seq
    ref_seq: int | None  # --ref-seq
    config: Any  # the model's HF config (its FLOPs per token at another length)

    def reference_lengths(self) -> list[int]:
        """The lengths the reference is tried at, in order, until one fits."""
        if self.ref_seq is not None:
            return [self.ref_seq]
        lengths = [self.seq]
        while lengths[-1] // 2 >= MIN_REFERENCE_SEQ:
            lengths.append(lengths[-1] // 2)
        return lengths

    def model_at(self, model: Model, seq_len: int) -> Model:
        """``model`` with its FLOPs per token at ``seq_len``."""
        if seq_len == self.seq:
            return model
        return dataclasses.replace(
            model, flops_per_token=model_flops_per_token(self.config, seq_len)
        )


def with_context_keys(overrides: list[str], configs: dict[str, Any]) -> dict[str, Any]:
    """``configs`` (ours and its variants) with ``CONTEXT_KEYS`` set; an explicit ``--set``
    of one of them to another value is one ``ConfigError`` line."""
    for item in overrides:
        key, _, value = item.partition("=")
        before, runtime, name = key.strip().rpartition("runtime.")
        if runtime and before in ("", *(f"{s}." for s in configs)) and name in CONTEXT_KEYS:
            wanted = str(CONTEXT_KEYS[name]).lower()
            if value.strip().lower() != wanted:
                raise ConfigError(
                    f"--set {item}: --context-parallel runs runtime.{name}={wanted} (what "
                    "context parallelism is checked with); leave it out"
                )
    return {
        name: {**config, "runtime": {**config["runtime"], **CONTEXT_KEYS}}
        for name, config in configs.items()
    }


def parse_context(
    args: argparse.Namespace, scale: Scale | None, ours: dict[str, Any], config: Any, device: str
) -> ContextBench | None:
    """``--context-parallel``/``--ref-seq`` checked against the ranks (on ``device``), the
    sequence and the model by the training's own preflight (``check_context``); one
    ``ConfigError`` line, or None without ``--context-parallel``."""
    r = args.context_parallel
    if r is None:
        if args.ref_seq is not None:
            raise ConfigError("--ref-seq needs --context-parallel R")
        return None
    if scale is None or r < 2 or scale.world % r:
        world = "N" if scale is None else str(scale.world)
        raise ConfigError(
            f"--context-parallel {r}: needs --gpus N (or --ranks N --device cpu) and R >= 2 "
            f"dividing the {world} ranks: use a divisor of {world} from 2 up"
        )
    if AUTO_ROUTE in scale.routes:
        raise ConfigError(
            "--routes auto: --context-parallel runs runtime.policy=fixed; name routes instead"
        )
    if args.ref_seq is not None and args.ref_seq < 2:
        raise ConfigError(f"--ref-seq {args.ref_seq}: needs 2 or more tokens")
    ranks = {"gpus" if device == "cuda" else "ranks": scale.world}
    raw = {
        **ours,
        "model": {**ours["model"], "path": "-"},
        "data": {**ours["data"], "seq_len": args.seq},
        "train": {**ours["train"], "global_batch_size": scale.world // r},
        "runtime": {**ours["runtime"], "device": device, "context_parallel": r, **ranks},
    }
    assert raw["runtime"]["policy"] != AUTO, "with_context_keys set it fixed"
    try:
        check_context(config_from_dict(raw), HFAdapter(config))
    except ConfigError as e:
        raise ConfigError(f"--context-parallel {r}: {e}") from None
    return ContextBench(size=r, seq=args.seq, ref_seq=args.ref_seq, config=config)


def context_report(bench: ContextBench, world: int) -> dict[str, Any]:
    """The report's ``context_parallel`` section: R, the groups, the keys the bench set."""
    keys = {f"runtime.{k}": v for k, v in CONTEXT_KEYS.items()}
    return {
        "size": bench.size,
        "groups": world // bench.size,
        "keys_set": {"runtime.context_parallel": bench.size, **keys},
        "tokens_per_step": "batch x seq x groups",
        "reference_seq_len_given": bench.ref_seq,
    }


def reference_projection(
    runs: list[dict[str, Any]], batch: int, world: int, flops_per_token: float, seq: int
) -> dict[str, Any]:
    """The reference on ``world`` GPUs at ``batch`` from its run on one: ``world`` x its
    FLOP/s over ``flops_per_token`` (at ``seq``), where it was measured and why."""
    tried = [r for r in runs if (r["system"], r["world"], r["batch"]) == ("reference", 1, batch)]
    ok = next((r for r in tried if r["status"] == "ok"), None)
    if ok is None:
        return {"reference_seq_len": None, "reference_projected_tokens_per_s": None,
                "reference_projection": "the reference did not run"}  # fmt: skip
    at = ok.get("seq_len", seq)
    projected = world * ok["tflops"] * 1e12 / flops_per_token
    if at == seq:
        how = f"measured at S={seq}: {world} x its tokens/s on 1"
    else:
        why = "S did not fit one GPU" if any(r["status"] == "oom" for r in tried) else "--ref-seq"
        how = (f"measured at S'={at} ({why}): {world} x its {ok['tflops']:.4g} TFLOP/s on 1 "
               f"/ FLOPs per token at S={seq}")  # fmt: skip
    return {"reference_seq_len": at, "reference_projected_tokens_per_s": projected,
            "reference_projection": how}  # fmt: skip


def print_context(report: dict[str, Any]) -> None:
    """The line that says what the bench set for context parallelism (none without it)."""
    cp = report.get("context_parallel")
    if cp is None:
        return
    unit = "GPUs" if report["device"] == "cuda" else "ranks"
    keys = ", ".join(f"{k}={str(v).lower()}" for k, v in cp["keys_set"].items())
    print(
        f"context parallel: each sequence over {cp['size']} of {report['world']} {unit}, "
        f"{cp['groups']} group(s) of rows (tokens per step: {cp['tokens_per_step']}); "
        f"set by the bench: {keys}; ours on {report['world']} {unit} only"
    )
