"""``slidedp bench nodes``: what the cross-node gradient all-reduce adds to a step.

Measured (``--device cpu``, on this machine): one seeded Qwen3-style model trained as 1 node of
``nodes x ranks`` ranks, then as ``nodes`` simulated nodes of ``ranks`` ranks (one host store
each, loopback rendezvous, each node started by ``slidedp train`` with ``runtime.nodes``), same
processes, same global batch. Printed: both step times (median after warm-up), their ratio, and
the ``nodes`` lane (the owners' all-reduce with the other nodes, ``metrics.jsonl``). The
simulated nodes share this machine's cores and each applies every AdamW: the ratio is an upper
bound on a real cluster's, the lane is the collective itself.

Predicted (``--predict SHAPE``): the step-time model (``plan.timing``) for one GPU of ``1..8``
nodes of ``--gpus-per-node`` GPUs joined by a ``--link-gbit`` link, with the engine's
synchronous collective (the backward waits for each layer's reduction) and with the reduction
on its own stream; every rate is ``plan.timing``'s (labelled as assumptions there).

Example::

    slidedp bench nodes --nodes 2 --ranks 1 --steps 8
    slidedp bench nodes --predict qwen3-4b --batch 16 --seq-len 1024 --link-gbit 400
"""

from __future__ import annotations

import argparse
import json
import math
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

import torch
import yaml

from slidedp.errors import ConfigError
from slidedp.models.hf import HFAdapter
from slidedp.plan.policy import resolve_policy
from slidedp.plan.timing import predict_step, reduce_s, spec_from_shapes
from slidedp.runtime.launch import free_port

WARMUP_STEPS = 2
NODE_RUN_TIMEOUT_S = 600  # one simulated multi-node run; its collectives time out sooner
VOCAB = 4096
H100_PEAK_FLOPS = 989e12  # dense bf16 (estimate.GPU_PEAK_FLOPS)
HOST_THREADS = 16  # AdamW at estimate.adamw_gbps(16), as `slidedp estimate` on the H100 host


def _write_run(root: Path, args: argparse.Namespace) -> Path:
    """A config-only Qwen3 model (seeded init), token data and the run's config; its path."""
    from transformers import Qwen3Config

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


def _train(config: Path, out: Path, nodes: int, ranks: int) -> list[dict[str, Any]]:
    """``slidedp train`` as ``nodes`` node launchers of ``ranks`` ranks; the measured steps.
    Each simulated node gets its share of this machine's cores (``OMP_NUM_THREADS``, which its
    ranks split again) and every rank the same host-update threads in both runs: otherwise
    the simulated nodes' thread pools would spin on the same cores."""
    cores = os.cpu_count() or 1
    common = [
        f"output.dir={out}",
        f"runtime.ranks={ranks}",
        f"runtime.nodes={nodes}",
        "runtime.master_addr=127.0.0.1",
        f"runtime.master_port={free_port()}",
        f"runtime.update_threads={max(1, cores // (2 * nodes * ranks))}",
    ]
    env = os.environ | {"OMP_NUM_THREADS": str(max(1, cores // nodes))}
    command = [sys.executable, "-m", "slidedp", "train", str(config), *common]
    procs = [
        subprocess.Popen(
            [*command, f"runtime.node_rank={n}"],
            env=env,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.PIPE,
            text=True,
        )
        for n in range(nodes)
    ]
    try:  # a hung node must not hang the bench: every collective times out well before
        errors = [p.communicate(timeout=NODE_RUN_TIMEOUT_S)[1] for p in procs]
    except subprocess.TimeoutExpired:
        for p in procs:
            p.kill()
        raise ConfigError(
            f"the {nodes}-node run did not finish in {NODE_RUN_TIMEOUT_S} s: a node hung"
        ) from None
    if any(p.returncode for p in procs):
        raise ConfigError(f"the {nodes}-node run failed: {' '.join(e.strip() for e in errors)}")
    lines = (out / "metrics.jsonl").read_text().splitlines()
    return [json.loads(line) for line in lines][WARMUP_STEPS:]


def _group_params(adapter: HFAdapter) -> list[int]:
    return [sum(math.prod(p.shape) for p in g.params) for g in adapter.group_specs()]


def measure(args: argparse.Namespace) -> dict[str, Any]:
    """Both runs on this machine (module docstring)."""
    with tempfile.TemporaryDirectory(prefix="slidedp-bench-nodes-") as tmp:
        root = Path(tmp)
        config = _write_run(root, args)
        params = sum(_group_params(HFAdapter.from_dir(root / "model")))
        one = _train(config, root / "one", 1, args.nodes * args.ranks)
        many = _train(config, root / "many", args.nodes, args.ranks)
    one_s = statistics.median(m["step_time_s"] for m in one)
    many_s = statistics.median(m["step_time_s"] for m in many)
    all_reduce_s = statistics.median(m["nodes_s"] for m in many)
    return {
        "params": params,
        "one_node_step_s": one_s,
        "nodes_step_s": many_s,
        "ratio": many_s / one_s,
        "all_reduce_s": all_reduce_s,
        "share": all_reduce_s / many_s,
        # f32 gradients on CPU; a ring moves 2 (N-1)/N of them per owner
        "all_reduce_gbps": 4 * params / all_reduce_s / 1e9 if all_reduce_s > 0 else None,
    }


def predict(args: argparse.Namespace) -> list[dict[str, Any]]:
    """One GPU's step for 1..8 nodes (module docstring), blocking and overlapped."""
    from slidedp.bench.shapes import resolve_shape
    from slidedp.config import RuntimeSection
    from slidedp.estimate import adamw_gbps

    adapter = HFAdapter(resolve_shape(args.predict))
    policy = resolve_policy(RuntimeSection(), adapter, mirror=True, device=torch.device("cuda"))
    spec = spec_from_shapes(
        adapter,
        policy,
        batch=args.batch,
        seq_len=args.seq_len,
        peak_flops=H100_PEAK_FLOPS,
        adamw_gbps=adamw_gbps(HOST_THREADS),
        clipping=True,
        offloaded_bytes=[0] * adapter.num_layers,
    )
    params = _group_params(adapter)
    rows = []
    for nodes in (1, 2, 4, 8):
        reduce = reduce_s(
            params, gpus_per_node=args.gpus_per_node, nodes=nodes, link_gbit_s=args.link_gbit
        )
        row: dict[str, Any] = {"nodes": nodes, "reduce_layer_s": reduce[1]}
        for blocks in (True, False):
            step = predict_step(spec | {"reduce_s": reduce, "reduce_blocks": blocks})["step_s"]
            row["blocking_s" if blocks else "overlapped_s"] = step
        rows.append(row)
    return rows


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--nodes", type=int, default=2, help="simulated nodes (measurement)")
    parser.add_argument("--ranks", type=int, default=1, help="CPU ranks per simulated node")
    parser.add_argument("--steps", type=int, default=8, help=f"steps ({WARMUP_STEPS} warm-up)")
    parser.add_argument("--hidden", type=int, default=512, help="hidden size of the model")
    parser.add_argument("--layers", type=int, default=4, help="decoder layers of the model")
    parser.add_argument("--batch", type=int, default=4, help="global batch (--predict: per GPU)")
    parser.add_argument("--seq-len", type=int, default=128, help="tokens per row")
    parser.add_argument("--predict", metavar="SHAPE", help="predict for SHAPE (bench.shapes)")
    parser.add_argument("--gpus-per-node", type=int, default=8, help="--predict: GPUs per node")
    parser.add_argument("--link-gbit", type=float, default=400.0, help="--predict: Gb/s link")
    parser.add_argument("--json", help="also write the numbers here")


def main(args: argparse.Namespace) -> int:
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
        result = measure(args)
        n, r = args.nodes, args.ranks
        print(
            f"slidedp bench nodes: MEASURED on this machine (CPU, gloo, loopback), "
            f"{result['params']:,} parameters, B={args.batch} x {args.seq_len}, median of "
            f"steps {WARMUP_STEPS + 1}..{args.steps}"
        )
        print(f"  1 node x {n * r} ranks: {result['one_node_step_s']:.3f} s/step")
        print(
            f"  {n} nodes x {r} ranks: {result['nodes_step_s']:.3f} s/step "
            f"({result['ratio']:.2f}x the single node)"
        )
        print(
            f"  cross-node all-reduce (nodes lane): {result['all_reduce_s'] * 1e3:.1f} ms/step "
            f"= {result['share']:.1%} of the {n}-node step"
        )
    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=1))
    return 0
