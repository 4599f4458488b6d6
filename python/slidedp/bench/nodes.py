"""``slidedp bench nodes``: what the cross-node gradient all-reduce adds to a step.

Trains one seeded model as 1 node of ``nodes x ranks`` ranks, then as ``nodes`` simulated nodes
(one host store each, loopback rendezvous, ``node_runs``), same data and global batch; prints
both step times, their ratio, the ``nodes`` lane and the loss parity (max |Δloss|). ``--device
cuda``: NCCL between the nodes (``--nccl-net``: its socket transport on loopback). The simulated
nodes share this machine's cores and memory bandwidth: the ratio is an upper bound on a real
cluster's. ``--predict SHAPE``: the step-time model (``plan.timing``) for 1..8 nodes.

Example::

    slidedp bench nodes --nodes 2 --ranks 1 --steps 8
    slidedp bench nodes --device cuda --nodes 2 --ranks 1 --steps 100 --nccl-net
    slidedp bench nodes --predict qwen3-4b --batch 16 --seq-len 1024 --link-gbit 400
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import tempfile
from dataclasses import replace
from pathlib import Path
from typing import Any

import torch
import yaml
from transformers import Qwen3Config

from slidedp.bench.node_runs import (
    NCCL_NET_ENV,
    NodeShape,
    nccl_transports,
    node_launches,
    run_nodes,
    visible_gpus,
)
from slidedp.bench.provenance import write_report
from slidedp.cli_args import count, positive, writable
from slidedp.config_runtime import RuntimeSection
from slidedp.errors import ConfigError
from slidedp.models.hf import HFAdapter
from slidedp.models.shapes import resolve_shape
from slidedp.plan.machine import adamw_gbps, gpu_peak
from slidedp.plan.policy import resolve_policy
from slidedp.plan.step_spec import predict_step
from slidedp.plan.timing import Rates, reduce_s, spec_from_shapes
from slidedp.runtime.launch import free_port

WARMUP_STEPS = 2
NODE_RUN_TIMEOUT_S = 600  # one simulated multi-node run; its collectives time out sooner
VOCAB = 4096
HOST_THREADS = 16  # AdamW at estimate.adamw_gbps(16), as `slidedp estimate` on the H100 host


def _write_run(root: Path, args: argparse.Namespace) -> Path:
    """A config-only Qwen3 model (seeded init), token data and the run's config; its path."""

    model = root / "model"
    Qwen3Config(
        hidden_size=args.hidden,
        intermediate_size=3 * args.hidden,
        num_hidden_layers=args.layers,
        num_attention_heads=args.hidden // 64,
        num_key_value_heads=max(1, args.hidden // 128),
        head_dim=64,
        vocab_size=VOCAB,
        max_position_embeddings=args.seq_len,
        tie_word_embeddings=False,
    ).save_pretrained(model)
    gen = torch.Generator().manual_seed(0)
    rows = args.batch * args.steps
    ids = torch.randint(0, VOCAB, (rows, args.seq_len), generator=gen).tolist()
    data = root / "data.jsonl"
    data.write_text("".join(json.dumps({"input_ids": r}) + "\n" for r in ids))
    raw = {
        "model": {"path": str(model)},
        "data": {"path": str(data), "seq_len": args.seq_len, "pad_id": 0, "shuffle": False},
        "train": {"max_steps": args.steps, "global_batch_size": args.batch, "max_grad_norm": 1.0},
        "output": {"dir": str(root / "out"), "export": False, "tensorboard": False},
        "runtime": {"device": "cpu", "version_timeout_s": 300},
    }
    config = root / "run.yaml"
    config.write_text(yaml.safe_dump(raw))
    return config


def _train(
    config: Path, out: Path, nodes: int, ranks: int, args: argparse.Namespace, *, nccl_net: bool
) -> tuple[list[dict[str, Any]], list[str]]:
    """``slidedp train`` as ``nodes`` node launchers of ``ranks`` ranks (``node_runs``): every
    step's metrics, and on CUDA the transports NCCL connected with."""
    cuda = args.device == "cuda"
    nccl_log = out.parent / f"{out.name}.nccl" if cuda else None
    launches = node_launches(
        config,
        out,
        NodeShape(nodes, ranks, args.device, visible_gpus() if cuda else ()),
        port=free_port(),
        cores=os.cpu_count() or 1,
        nccl_net=nccl_net,
        nccl_log=nccl_log,
    )
    run_nodes(launches, NODE_RUN_TIMEOUT_S)
    lines = (out / "metrics.jsonl").read_text().splitlines()
    records = [json.loads(line) for line in lines]
    if len(records) != args.steps:
        raise ConfigError(f"the {nodes}-node run logged {len(records)} of {args.steps} steps")
    return records, [] if nccl_log is None else nccl_transports(nccl_log)


def measure(args: argparse.Namespace) -> dict[str, Any]:
    """Both runs on this machine (module docstring)."""
    with tempfile.TemporaryDirectory(prefix="slidedp-bench-nodes-") as tmp:
        root = Path(tmp)
        config = _write_run(root, args)
        params = sum(g.numel for g in HFAdapter.from_dir(root / "model").group_specs())
        one, one_via = _train(
            config, root / "one", 1, args.nodes * args.ranks, args, nccl_net=False
        )
        many, many_via = _train(
            config, root / "many", args.nodes, args.ranks, args, nccl_net=args.nccl_net
        )
    one_s = statistics.median(m["step_time_s"] for m in one[WARMUP_STEPS:])
    many_s = statistics.median(m["step_time_s"] for m in many[WARMUP_STEPS:])
    all_reduce_s = statistics.median(m["nodes_s"] for m in many[WARMUP_STEPS:])
    one_losses, many_losses = [m["loss"] for m in one], [m["loss"] for m in many]
    grad_bytes = 2 if args.device == "cuda" else 4  # bf16 gradients on CUDA, f32 on CPU
    return {
        "device": args.device,
        "dtype": "bfloat16" if args.device == "cuda" else "float32",
        "nodes": args.nodes,
        "ranks": args.ranks,
        "steps": args.steps,
        "warmup_steps": WARMUP_STEPS,
        "params": params,
        "one_node_step_s": one_s,
        "nodes_step_s": many_s,
        "ratio": many_s / one_s,
        "all_reduce_s": all_reduce_s,
        "share": all_reduce_s / many_s,
        # a ring moves 2 (N-1)/N of them per owner
        "all_reduce_gbps": grad_bytes * params / all_reduce_s / 1e9 if all_reduce_s > 0 else None,
        "max_abs_dloss": max(abs(a - b) for a, b in zip(one_losses, many_losses, strict=True)),
        "one_node_losses": one_losses,
        "nodes_losses": many_losses,
        "nccl_net": args.nccl_net,
        "nccl_net_env": NCCL_NET_ENV if args.nccl_net else {},
        "one_node_transports": one_via,  # NCCL's, read from its log (CUDA only)
        "nodes_transports": many_via,
    }


def predict(args: argparse.Namespace) -> list[dict[str, Any]]:
    """One GPU's step for 1..8 nodes (module docstring), blocking and overlapped."""

    adapter = HFAdapter(resolve_shape(args.predict))
    policy = resolve_policy(RuntimeSection(), adapter, mirror=True, device=torch.device("cuda"))
    spec = spec_from_shapes(
        adapter,
        policy,
        batch=args.batch,
        seq_len=args.seq_len,
        # dense bf16, plan.machine.GPU_PEAK_FLOPS
        rates=Rates(gpu_peak("H100")[0] or 0.0, adamw_gbps(HOST_THREADS)),
        clipping=True,
        offloaded_bytes=[0] * adapter.num_layers,
    )
    params = [g.numel for g in adapter.group_specs()]
    rows = []
    for nodes in (1, 2, 4, 8):
        reduce = reduce_s(
            params, gpus_per_node=args.gpus_per_node, nodes=nodes, link_gbit_s=args.link_gbit
        )
        row: dict[str, Any] = {"nodes": nodes, "reduce_layer_s": reduce[1]}
        for blocks in (True, False):
            across = replace(spec, reduce_s=tuple(reduce), reduce_blocks=blocks)
            step = predict_step(across).step_s
            row["blocking_s" if blocks else "overlapped_s"] = step
        rows.append(row)
    return rows


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--nodes", type=int, default=2, help="simulated nodes (measurement)")
    parser.add_argument(
        "--ranks", type=int, default=1, help="ranks per simulated node (CPU ranks or GPUs)"
    )
    parser.add_argument(
        "--device",
        choices=("cpu", "cuda"),
        default="cpu",
        help="cpu: CPU ranks, f32, gloo; cuda: one GPU per rank, bf16, NCCL",
    )
    parser.add_argument(
        "--nccl-net",
        action="store_true",
        help="--device cuda: the simulated nodes' NCCL on its network transport (sockets on "
        "loopback: NCCL_P2P_DISABLE=1 NCCL_SHM_DISABLE=1 NCCL_IB_DISABLE=1), not NVLink",
    )
    arg = parser.add_argument
    arg("--steps", type=count(1), default=8, help=f"steps ({WARMUP_STEPS} warm-up)")
    arg("--hidden", type=count(1), default=512, help="hidden size of the model")
    arg("--layers", type=count(1), default=4, help="decoder layers of the model")
    arg("--batch", type=count(1), default=4, help="global batch (--predict: per GPU)")
    arg("--seq-len", type=count(1), default=128, help="tokens per row")
    arg("--predict", metavar="SHAPE", help="predict for SHAPE (models.shapes)")
    arg("--gpus-per-node", type=count(1), default=8, help="--predict: GPUs per node")
    arg("--link-gbit", type=positive, default=400.0, help="--predict: Gb/s link")
    arg("--json", help="also write the numbers and this run's facts here")


def main(args: argparse.Namespace) -> int:
    writable("--json", args.json)
    if args.predict:
        result: Any = predict(args)
        print(
            f"slidedp bench nodes: PREDICTION (step-time model, rates assumed in "
            f"plan/timing.py) for {args.predict}, one GPU's step, B={args.batch} per GPU x "
            f"{args.seq_len}, clipping, {args.gpus_per_node} GPUs/node (H100 bf16), "
            f"{args.link_gbit:g} Gb/s between nodes"
        )
        base = result[0]
        print(
            f"{'nodes':>5} {'reduce/layer':>13} {'step (engine)':>14} {'vs 1':>6} "
            f"{'step (own stream)':>18} {'vs 1':>6}"
        )
        for r in result:
            print(
                f"{r['nodes']:5d} {r['reduce_layer_s'] * 1e3:10.2f} ms {r['blocking_s']:12.3f} s"
                f" {r['blocking_s'] / base['blocking_s']:6.3f} {r['overlapped_s']:16.3f} s"
                f" {r['overlapped_s'] / base['overlapped_s']:6.3f}"
            )
    else:
        if args.nodes < 2 or args.ranks < 1 or args.steps <= WARMUP_STEPS:
            raise ConfigError(f"--nodes must be >= 2, --ranks >= 1 and --steps > {WARMUP_STEPS}")
        if args.nccl_net and args.device != "cuda":
            raise ConfigError("--nccl-net needs --device cuda (CPU nodes talk over gloo)")
        if args.device == "cuda" and not torch.cuda.is_available():
            raise ConfigError("--device cuda needs CUDA, which this machine lacks: --device cpu")
        result = measure(args)
        _print_measured(args, result)
    write_report(args.json, result)
    return 0


def _transports(names: list[str]) -> str:
    return "+".join(names) or "not in NCCL's log"


def _print_measured(args: argparse.Namespace, result: dict[str, Any]) -> None:
    n, r = args.nodes, args.ranks
    cuda = args.device == "cuda"
    unit = "GPU" if cuda else "rank"
    how = "CUDA, bf16, NCCL" if cuda else "CPU, f32, gloo, loopback"
    print(
        f"slidedp bench nodes: MEASURED on this machine ({how}), {result['params']:,} "
        f"parameters, B={args.batch} x {args.seq_len}, median of steps "
        f"{WARMUP_STEPS + 1}..{args.steps}"
    )
    one = f"  1 node x {n * r} {unit}s: {result['one_node_step_s']:.3f} s/step"
    print(one + (f" (NCCL: {_transports(result['one_node_transports'])})" if cuda else ""))
    print(
        f"  {n} nodes x {r} {unit}{'s' if r > 1 else ''}: {result['nodes_step_s']:.3f} s/step "
        f"({result['ratio']:.2f}x the single node)"
    )
    print(
        f"  cross-node all-reduce (nodes lane): {result['all_reduce_s'] * 1e3:.1f} ms/step "
        f"= {result['share']:.1%} of the {n}-node step"
    )
    if cuda:
        forced = " ".join(f"{k}={v}" for k, v in result["nccl_net_env"].items())
        print(
            f"  between the nodes, NCCL: {_transports(result['nodes_transports'])}"
            + (f" ({forced})" if forced else " (NCCL's own choice on one host)")
        )
    print(
        f"  loss parity: max |dloss| {result['max_abs_dloss']:.2e} over all {args.steps} steps "
        "(same seeded model, data and global batch)"
    )
