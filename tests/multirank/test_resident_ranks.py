"""GPU-resident layers and embeddings on 2 CPU ranks (gloo, ``runtime/resident.py``): each group's
FP32 master and moments live on its owner only, which updates them with the host AdamW kernel
and broadcasts the weights; the run is the 2-rank all-host run bit for bit (losses, norms, clip
coefficients, every checkpoint tensor: weights and both moments, the export), mid-run
checkpoints included, and a resumed run continues exactly. No tolerance: both runs sum each
gradient onto the same owner with the same collective and take the same per-parameter norms in
the same order; only where the update runs differs.

The ranks are forked from the test process, so a spy set up here runs in them: it records, per
rank, the groups the window loads, the host update lane updates and the resident update updates.
"""

from __future__ import annotations

import os
from collections import Counter
from pathlib import Path
from typing import Any

import pytest
import torch

from cli.util import one_error_line, run
from engine.test_resident import _poison_gradient
from engine.tiny import (
    assert_bitwise_equal,
    make_model,
    read_metrics,
    saved_tensors,
    write_config,
    write_data,
)
from multirank.ranks import run_ranks
from slidedp.models.hf import HFAdapter
from slidedp.plan.cost import resident_rank_bytes
from slidedp.runtime.resident import ResidentLayers
from slidedp.runtime.trainer import Trainer
from slidedp.runtime.window import DeviceBuffer, Window
from slidedp.store import HostStore, StateRegion
from slidedp.update import UpdateWorker

pytestmark = pytest.mark.e2e  # every test here trains end to end

LAYERS = 3
TRAIN = {
    "max_steps": 6,
    "global_batch_size": 4,
    "learning_rate": 3e-3,
    "weight_decay": 0.1,
    "warmup_steps": 2,
}


def _spy(monkeypatch: pytest.MonkeyPatch, log: Path) -> None:
    """Each rank appends ``RANK what group`` lines to ``log``: ``load`` (the window), ``host``
    (the host update lane, nonzero length), ``device`` (the resident update), ``state`` (the
    groups whose FP32 state the rank holds, once at the start) and ``bytes`` (in place of a
    group: the device bytes it holds for them, the embeddings' weights aside: the window's)."""

    def note(what: str, group: int) -> None:
        with log.open("a") as f:  # one short line per write: the ranks' lines never interleave
            f.write(f"{os.environ.get('RANK', '0')} {what} {group}\n")

    load, submit = Window.load, UpdateWorker.submit
    update, init = ResidentLayers._update, ResidentLayers.__init__

    def spy_load(window: Window, buf: DeviceBuffer, group: int, version: int) -> None:
        note("load", group)
        load(window, buf, group, version)

    def spy_submit(worker: UpdateWorker, group: int, start: int, length: int,
                   *args: Any, **kwargs: Any) -> int:  # fmt: skip
        if length:
            note("host", group)
        return submit(worker, group, start, length, *args, **kwargs)

    def spy_update(resident: ResidentLayers, scale: torch.Tensor) -> None:
        for ticket, _ in resident._pending:
            note("device", ticket.group)
        update(resident, scale)

    def spy_init(resident: ResidentLayers, *args: Any, **kwargs: Any) -> None:
        init(resident, *args, **kwargs)
        for group, g in resident._groups.items():
            if g.state:
                note("state", group)
        embeddings = (resident.store.num_groups - 1, 0)  # the head and the embedding
        layers = [g.weights.flat for n, g in resident._groups.items() if n not in embeddings]
        weights = sum(w.numel() * w.element_size() for w in layers)
        note("bytes", resident.state_bytes + weights)

    monkeypatch.setattr(Window, "load", spy_load)
    monkeypatch.setattr(UpdateWorker, "submit", spy_submit)
    monkeypatch.setattr(ResidentLayers, "_update", spy_update)
    monkeypatch.setattr(ResidentLayers, "__init__", spy_init)


def _seen(log: Path, what: str) -> dict[int, set[int]]:
    """``rank -> groups`` of ``what`` in the spy's log."""
    seen: dict[int, set[int]] = {0: set(), 1: set()}
    for line in log.read_text().splitlines() if log.exists() else []:
        rank, kind, group = line.split()
        if kind == what:
            seen[int(rank)].add(int(group))
    return seen


def _two_ranks(tmp_path: Path, model: Path, data: Path, name: str, *overrides: str,
               **runtime: Any) -> Path:  # fmt: skip
    out = tmp_path / name
    config = write_config(tmp_path / f"{name}.yaml", model, data, out, train=TRAIN,
                          runtime={"ranks": 2, "chunk_elems": 1000} | runtime,
                          output={"tensorboard": False, "save_steps": 3})  # fmt: skip
    assert run_ranks(config, 2, list(overrides)) == [0, 0]
    return out


# (architecture, tied, clipping, param route): clipping binding (the grad norms of these runs
# lie in 1.6 .. 3.7: 1.0 clips every step) and off (the no-clip update gate), both param routes
CASES = [
    ("qwen3", True, 1.0, "replicated"),
    ("llama", False, 0.0, "sharded"),
]


@pytest.mark.parametrize(("arch", "tied", "clip", "param_route"), CASES)
def test_two_ranks_with_resident_layers_train_bit_for_bit_like_the_all_host_two(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, arch: str, tied: bool, clip: float,
    param_route: str,
) -> None:  # fmt: skip
    model = make_model(tmp_path, arch, tied=tied, layers=LAYERS)
    data = write_data(tmp_path / "data.jsonl", 30)
    adapter = HFAdapter.from_dir(model)
    clipping = f"train.max_grad_norm={clip}"
    host = _two_ranks(tmp_path, model, data, "host", clipping, param_route=param_route)
    expected = read_metrics(host)
    assert any(r["clip_coef"] < 1 for r in expected) == (clip > 0)
    for k, embeddings in ((2, False), (LAYERS, True)):
        log = tmp_path / f"spy-{k}.log"
        _spy(monkeypatch, log)
        name = f"resident-{k}{'-embeddings' if embeddings else ''}"
        out = _two_ranks(tmp_path, model, data, name, clipping, f"runtime.resident_layers={k}",
                         f"runtime.resident_embeddings={embeddings}",
                         param_route=param_route)  # fmt: skip
        resident = {adapter.layer_group(i) for i in range(k)}
        resident |= {adapter.embed_group, adapter.head_group} if embeddings else set()
        loaded, host_updated = _seen(log, "load"), _seen(log, "host")
        device_updated, state = _seen(log, "device"), _seen(log, "state")
        for rank in (0, 1):  # each rank owns every other group (Dist.owner: group % 2)
            owned = {g for g in resident if g % 2 == rank}
            assert not loaded[rank] & resident, (name, rank)
            assert not host_updated[rank] & resident, (name, rank)
            assert state[rank] == owned, (name, rank)  # about half of the state each
            assert device_updated[rank] == owned, (name, rank)
        if clip > 0:  # the accounting's worst rank (without clipping it adds the gradients)
            counted = resident_rank_bytes(adapter, torch.float32, clipping=True, layers=k,
                                          embeddings=embeddings, ranks=2)  # fmt: skip
            assert max(max(b) for b in _seen(log, "bytes").values()) == counted
        got = read_metrics(out)
        for key in ("loss", "grad_norm", "clip_coef", "lr"):
            assert [r[key] for r in got] == [r[key] for r in expected], (name, key)
        for saved in ("checkpoint-3", "checkpoint-6", "final"):  # weights and both moments
            assert_bitwise_equal(saved_tensors(out / saved), saved_tensors(host / saved))


def _spy_start_reads(monkeypatch: pytest.MonkeyPatch, log: Path) -> None:
    """Each rank appends ``RANK region group`` to ``log`` for each range of a group's state
    the store hands out before the training loop starts (``Trainer.run``)."""
    group_state, run = HostStore.group_state, Trainer.run
    started = False

    def spy_state(store: HostStore, group: int, region: StateRegion) -> torch.Tensor:
        if not started:
            with log.open("a") as f:
                f.write(f"{os.environ.get('RANK', '0')} {region} {group}\n")
        return group_state(store, group, region)

    def spy_run(trainer: Trainer) -> list[dict[str, Any]]:
        nonlocal started
        started = True
        return run(trainer)

    monkeypatch.setattr(HostStore, "group_state", spy_state)
    monkeypatch.setattr(Trainer, "run", spy_run)


def test_two_ranks_resume_resident_layers_exactly(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A 2-rank run with resident layers and embeddings resumed from its mid-run checkpoint
    (each owner loads its groups' state from the store) continues as the uninterrupted run.
    The resume reads each state once: an owner its groups' master and moments, the other rank
    the master its weights are cast from (CPU f32: no BF16 mirror)."""
    model = make_model(tmp_path, "qwen3", tied=True, layers=LAYERS)
    data = write_data(tmp_path / "data.jsonl", 30)
    resident = ("runtime.resident_layers=2", "runtime.resident_embeddings=true",
                "train.max_grad_norm=1.0")  # fmt: skip
    full = _two_ranks(tmp_path, model, data, "full", *resident)
    log = tmp_path / "reads.log"
    _spy_start_reads(monkeypatch, log)
    resumed = _two_ranks(tmp_path, model, data, "resumed", *resident,
                         f"train.resume={full / 'checkpoint-3'}")  # fmt: skip
    a = HFAdapter.from_dir(model)
    groups = {a.layer_group(0), a.layer_group(1), a.embed_group, a.head_group}
    reads = Counter(tuple(line.split()) for line in log.read_text().splitlines())
    for rank in (0, 1):
        for g in groups:
            owned = g % 2 == rank
            want = {"master": 1, "exp_avg": int(owned), "exp_avg_sq": int(owned)}
            got_reads = {r: reads[str(rank), r, str(g)] for r in want}
            assert got_reads == want, (rank, g)
    got, uninterrupted = read_metrics(resumed), read_metrics(full)
    assert [r["step"] for r in got] == [4, 5, 6]
    for key in ("loss", "grad_norm", "clip_coef"):
        assert [r[key] for r in got] == [r[key] for r in uninterrupted[3:]], key
    for saved in ("checkpoint-6", "final"):
        assert_bitwise_equal(saved_tensors(resumed / saved), saved_tensors(full / saved))


def test_two_nodes_of_two_ranks_with_resident_groups_train_like_the_all_host_run(
    tmp_path: Path,
) -> None:
    """2 simulated nodes of 2 ranks: each node's owners update their groups (the gradient
    all-reduced across the nodes' owners first), broadcast within their node and write their
    node's store; bit for bit the all-host run of the same nodes."""
    model = make_model(tmp_path, "qwen3", tied=False, layers=LAYERS)
    data = write_data(tmp_path / "data.jsonl", 30)
    runs = {}
    kept = ("runtime.resident_layers=2", "runtime.resident_embeddings=true")
    for name, resident in (("host", ()), ("resident", kept)):
        out = tmp_path / name
        config = write_config(tmp_path / f"{name}.yaml", model, data, out, train=TRAIN,
                              runtime={"ranks": 2, "chunk_elems": 1000},
                              output={"tensorboard": False, "save_steps": 3})  # fmt: skip
        overrides = ["train.max_grad_norm=1.0", *resident]
        assert run_ranks(config, 4, overrides, nodes=2) == [0] * 4
        runs[name] = out
    host, resident_run = read_metrics(runs["host"]), read_metrics(runs["resident"])
    for key in ("loss", "grad_norm", "clip_coef"):
        assert [r[key] for r in resident_run] == [r[key] for r in host], key
    for saved in ("checkpoint-3", "final"):
        assert_bitwise_equal(
            saved_tensors(runs["resident"] / saved), saved_tensors(runs["host"] / saved)
        )


def test_a_non_finite_resident_gradient_skips_the_step_on_every_rank(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """With clipping and ``on_nonfinite=skip`` an infinite gradient in a resident layer skips
    the step on both ranks (the owner's update gated off, the broadcast sending the unchanged
    weights): the same records and checkpoint as the all-host run's skip."""
    model = make_model(tmp_path, "qwen3", tied=True, layers=LAYERS)
    data = write_data(tmp_path / "data.jsonl", 30)
    _poison_gradient(monkeypatch, HFAdapter.from_dir(model).layer_group(1), call=1)
    skip = ("train.max_grad_norm=1.0", "train.on_nonfinite=skip")
    host = _two_ranks(tmp_path, model, data, "host", *skip)
    resident = _two_ranks(tmp_path, model, data, "resident", *skip, "runtime.resident_layers=2")
    records = read_metrics(resident)
    assert records[1]["skipped"] is True
    assert [r.get("loss") for r in records] == [r.get("loss") for r in read_metrics(host)]
    assert_bitwise_equal(
        saved_tensors(resident / "checkpoint-6"), saved_tensors(host / "checkpoint-6")
    )


def test_resident_layers_on_the_cpu_gradient_route_of_several_ranks_are_refused(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    model = make_model(tmp_path, "qwen3", tied=True, layers=LAYERS)
    data = write_data(tmp_path / "data.jsonl", 8)
    config = write_config(tmp_path / "c.yaml", model, data, tmp_path / "out")
    for key in ("runtime.resident_layers=1", "runtime.resident_embeddings=true"):
        for command in ("validate", "train"):
            code, _, err = run(capsys, command, str(config), key, "runtime.ranks=2",
                               "runtime.grad_route=cpu")  # fmt: skip
            assert code == 2
            one_error_line(err, command, key, "on 2 ranks needs runtime.grad_route=gpu")
    assert not (tmp_path / "out").exists()
