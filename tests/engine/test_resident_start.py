"""The start of a run with GPU-resident layers (``runtime/resident.py``), on CPU f32: what the
resident groups read out of the host store. A fresh run reads their master weights once and
never their Adam moments (zero in a fresh store as on the device; reading them faults in every
page of them); a resumed one reads the master and the moments, each once. Bit parity with the
all-host run is tests/engine/test_resident.py's."""

from __future__ import annotations

import subprocess
import sys
from collections import Counter
from pathlib import Path
from typing import Any, cast

import pytest
import torch
from transformers import Qwen3Config

from engine.tiny import make_model, write_config, write_data
from slidedp.config import load_config
from slidedp.kernels import Kernels
from slidedp.models.hf import HFAdapter
from slidedp.runtime.dist import Dist
from slidedp.runtime.resident import REGIONS, Owners, ResidentLayers, group_params
from slidedp.runtime.trainer import Trainer
from slidedp.runtime.window import DeviceBuffer, fill_mirror
from slidedp.store import HostStore, StateRegion

RESIDENT = ["runtime.resident_layers=2", "runtime.resident_embeddings=true"]


@pytest.fixture
def run_config(tmp_path: Path) -> Path:
    model = make_model(tmp_path, "qwen3", tied=False, layers=3)
    data = write_data(tmp_path / "data.jsonl", 8)
    return write_config(tmp_path / "c.yaml", model, data, tmp_path / "out",
                        train={"max_steps": 2, "global_batch_size": 4})  # fmt: skip


class _Reads:
    """(group, region) -> how often the store handed out that range of its state."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch) -> None:
        self.count: Counter[tuple[int, str]] = Counter()
        group_state = HostStore.group_state

        def spy(store: HostStore, group: int, region: StateRegion) -> object:
            self.count[group, region] += 1
            return group_state(store, group, region)

        monkeypatch.setattr(HostStore, "group_state", spy)

    def of(self, groups: list[int], region: str) -> list[int]:
        return [self.count[g, region] for g in groups]


def test_a_fresh_start_reads_the_master_once_and_no_moment(
    run_config: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    reads = _Reads(monkeypatch)
    trainer = Trainer(load_config(run_config, RESIDENT), log=False)
    try:
        a = trainer.adapter
        groups = [a.layer_group(0), a.layer_group(1), a.embed_group, a.head_group]
        assert reads.of(groups, "master") == [1] * 4
        assert reads.of(groups, "exp_avg") == reads.of(groups, "exp_avg_sq") == [0] * 4
        resident = trainer.engine.resident
        assert resident is not None
        reads.count.clear()
        trainer.engine.start_at(1)  # a resume: its moments come from the store
        assert reads.of(groups, "exp_avg") == reads.of(groups, "exp_avg_sq") == [1] * 4
    finally:
        trainer.engine.close()


@pytest.mark.e2e
def test_a_resume_reads_each_state_once(
    tmp_path: Path, run_config: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A run resumed from its checkpoint reads each resident group's master (at the engine's
    start) and moments (``start_at``) out of the store once: the master is not read again
    with the moments. That the resumed run continues exactly is test_resident.py's."""
    saving = [*RESIDENT, "output.save_steps=1"]
    Trainer(load_config(run_config, saving), log=False).run()
    checkpoint = tmp_path / "out" / "checkpoint-1"
    reads = _Reads(monkeypatch)
    resume = [f"train.resume={checkpoint}", f"output.dir={tmp_path / 'resumed'}"]
    trainer = Trainer(load_config(run_config, [*RESIDENT, *resume]), log=False)
    try:
        a = trainer.adapter
        groups = [a.layer_group(0), a.layer_group(1), a.embed_group, a.head_group]
        for region in REGIONS:
            assert reads.of(groups, region) == [1] * 4, region
    finally:
        trainer.engine.close()


class _Window:
    """What ``ResidentLayers`` asks of the window: each group's own buffer (BF16, CPU)."""

    def __init__(self, store: HostStore) -> None:
        self.store = store

    def own_buffer(self, group: int) -> DeviceBuffer:
        return DeviceBuffer(self.store.layout.groups[group].slot_len, torch.bfloat16,
                            torch.device("cpu"))  # fmt: skip


def test_a_group_another_rank_owns_takes_its_weights_from_the_mirror(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Local rank 0 of 2 (owners by group parity) on a store with the BF16 mirror: the groups
    of rank 1 read no master from the store, and their weights are the master's cast bit for
    bit; rank 0's own groups read their master and cast it themselves."""
    config = Qwen3Config(hidden_size=64, intermediate_size=96, num_hidden_layers=3,
                         num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                         vocab_size=128, tie_word_embeddings=False)  # fmt: skip
    adapter = HFAdapter(config)
    store = HostStore.create(adapter.group_specs(), 0, str(tmp_path), "bf16", 4, None, True)
    torch.manual_seed(0)
    store.region("master").copy_(torch.randn(store.region("master").numel()))
    fill_mirror(store, Kernels(1))
    groups = [adapter.layer_group(i) for i in range(3)] + [adapter.embed_group]
    rank0 = Dist(rank=0, world=2, local_rank=0, local_world=2)
    owners = Owners(rank0, cast(Any, None))  # the group is only used by the update
    reads = _Reads(monkeypatch)
    resident = ResidentLayers(store, cast(Any, _Window(store)), Kernels(1), cast(Any, None),
                              groups, torch.device("cpu"), owners)  # fmt: skip
    for g in groups:
        assert reads.count[g, "master"] == (1 if rank0.owns(g) else 0), g
        weights = resident.buffer(g).flat
        for p in group_params(store.layout, g):
            cast_by_torch = store.param(p.name).view(-1).bfloat16()
            got = weights[p.slot_at : p.slot_at + p.numel]
            assert torch.equal(got.view(torch.int16), cast_by_torch.view(torch.int16)), p.name
    assert {rank0.owns(g) for g in groups} == {True, False}  # both kinds were checked


@pytest.mark.e2e
def test_the_update_pass_compiles_once_for_every_group() -> None:
    """The compiled update (the CUDA path, run on CPU tensors) over every group of a model
    whose resident embedding comes first, twice, compiles one graph: the embedding's tensor
    spans its group's state, so a trace with duck sizing guarded on that equality and compiled
    again for the first layer (a second compile in the first step on the GPU). In a fresh
    interpreter: nothing compiled before."""
    code = """
import torch
from torch._dynamo.utils import counters
from transformers import Qwen3Config
from slidedp.models.hf import HFAdapter
from slidedp.runtime.grad_lane import AdamArgs
from slidedp.runtime.resident import (REGIONS, _compiled_pass, _Group, adamw_single_pass,
                                      group_params, hyperparameters)
from slidedp.runtime.window import DeviceBuffer
from slidedp.store import HostStore
config = Qwen3Config(hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                     num_attention_heads=4, num_key_value_heads=2, head_dim=16, vocab_size=128,
                     tie_word_embeddings=False)
adapter, cpu = HFAdapter(config), torch.device("cpu")
layout = HostStore.plan(adapter.group_specs(), 0, "bf16", 4, None, True)
groups = []
for g, spec in enumerate(layout.groups):
    state = {r: torch.zeros(spec.state_len if r == "master" else spec.trained_len)
             for r in REGIONS}
    weights = DeviceBuffer(spec.slot_len, torch.bfloat16, cpu)
    groups.append(_Group(g, group_params(layout, g), state, weights))
assert layout.groups[0].state_len == groups[0].params[0].numel  # the embedding comes first
adam = AdamArgs(1, 1e-3, (0.9, 0.95), 1e-8, 0.1, 1.0, 1)
hyper = {d: hyperparameters(adam, d, cpu) for d in (True, False)}
for step in range(2):
    for g in groups:
        grads = {p.name: torch.randn(p.numel).bfloat16() for p in g.trained}
        adamw_single_pass(g, grads, hyper, torch.tensor([1.0, 1.0]), _compiled_pass())
print(counters["stats"]["unique_graphs"])
"""
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         timeout=300, check=False)  # fmt: skip
    assert out.returncode == 0, out.stderr
    assert int(out.stdout.split()[-1]) == 1
