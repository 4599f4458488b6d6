"""Mixture-of-experts checkpoints in the hub's per-expert layout (``slidedp.io.hub_experts``).

A tiny seeded Qwen3-MoE, Mixtral, Qwen3.5-MoE and OLMoE (12 experts: ``experts.10`` sorts before
``experts.2`` by name) saved twice: by ``save_pretrained`` (one tensor per expert, the hub's
layout) and with the model's own fused expert parameters. Loaded through slidedp, both give
masters equal to the model's parameters bit for bit and to what ``from_pretrained`` (transformers'
own conversion) makes of the per-expert files; trained from either, the losses are the same;
exported, the fused checkpoint loads back into transformers unchanged. A damaged or mixed
layout is one line, exit 2, nothing written.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
import yaml
from safetensors import safe_open
from safetensors.torch import load_file, save_file
from transformers import AutoModelForCausalLM

from cli.util import one_error_line, run, snapshot
from engine.tiny import make_model, read_metrics, write_config, write_data
from slidedp.io.hf_load import fill_master
from slidedp.io.hub_experts import HUB_NAMES
from slidedp.models.hf import MOE_MODEL_TYPES, HFAdapter
from slidedp.store import HostStore

Capsys = pytest.CaptureFixture[str]
ARCHS = ("qwen3_moe", "mixtral", "olmoe", "qwen3_5_moe_text")


def _names(path: Path) -> list[str]:
    with safe_open(str(path / "model.safetensors"), framework="pt") as f:
        return list(f.keys())


def _masters(path: Path) -> tuple[dict[str, torch.Tensor], str]:
    adapter = HFAdapter.from_dir(path)
    store = HostStore.create(adapter.group_specs(), staging_slots=2)
    how = fill_master(adapter, store, seed=0)
    return {n: store.param(n).clone() for _, n in adapter.iter_params()}, how


def test_every_moe_model_type_has_its_hub_names() -> None:
    assert set(HUB_NAMES) == set(MOE_MODEL_TYPES) == set(ARCHS)


@pytest.mark.parametrize("arch", ARCHS)
def test_per_expert_files_load_into_the_fused_masters_as_transformers_loads_them(
    tmp_path: Path, arch: str
) -> None:
    hub = make_model(tmp_path, arch, tied=False, per_expert=True)
    fused = make_model(tmp_path, arch, tied=False)  # the same seed: the same parameters
    names = _names(hub)
    assert any(".experts.11." in n or ".experts.3." in n for n in names)  # one per expert
    assert not any(n.endswith("gate_up_proj") for n in names)
    assert any(n.endswith("experts.gate_up_proj") for n in _names(fused))

    masters, how = _masters(hub)
    assert how == "loaded 1 safetensors file(s), experts one tensor each (fused on load)"
    # the model's own parameters, as saved fused
    expected = load_file(fused / "model.safetensors")
    assert masters.keys() == expected.keys()
    assert all(torch.equal(masters[n], expected[n]) for n in masters)
    # transformers' conversion of the same per-expert files
    model = AutoModelForCausalLM.from_pretrained(hub, dtype=torch.float32)
    theirs = dict(model.named_parameters())
    assert all(torch.equal(masters[n], theirs[n].detach()) for n in masters)
    assert _masters(fused)[1] == "loaded 1 safetensors file(s)"


def test_a_layer_s_experts_may_lie_in_several_shards(tmp_path: Path) -> None:
    hub = make_model(tmp_path, "qwen3_moe", tied=False, per_expert=True)
    weights = load_file(hub / "model.safetensors")
    names = sorted(weights)  # every other tensor to each shard: an expert's are split too
    shards = {"model-00001-of-00002.safetensors": names[::2],
              "model-00002-of-00002.safetensors": names[1::2]}  # fmt: skip
    for file, part in shards.items():
        save_file({n: weights[n] for n in part}, hub / file, metadata={"format": "pt"})
    (hub / "model.safetensors").unlink()
    weight_map = {n: file for file, part in shards.items() for n in part}
    index = {"metadata": {}, "weight_map": weight_map}
    (hub / "model.safetensors.index.json").write_text(json.dumps(index))
    masters, how = _masters(hub)
    assert how.startswith("loaded 2 safetensors file(s), experts one tensor each")
    model = AutoModelForCausalLM.from_pretrained(hub, dtype=torch.float32)
    theirs = dict(model.named_parameters())
    assert all(torch.equal(masters[n], theirs[n].detach()) for n in masters)


def test_bf16_per_expert_files_are_cast_into_the_f32_masters(tmp_path: Path) -> None:
    hub = make_model(tmp_path, "mixtral", tied=True, per_expert=True)
    weights = load_file(hub / "model.safetensors")
    save_file({n: t.to(torch.bfloat16) for n, t in weights.items()}, hub / "model.safetensors")
    masters, _ = _masters(hub)
    model = AutoModelForCausalLM.from_pretrained(hub, dtype=torch.float32)
    theirs = dict(model.named_parameters())
    assert all(torch.equal(masters[n], theirs[n].detach()) for n in masters)
    assert masters["model.layers.1.mlp.experts.down_proj"].dtype == torch.float32


@pytest.mark.e2e
@pytest.mark.parametrize("arch", ARCHS)
def test_training_from_either_layout_gives_the_same_losses_and_exports_fused(
    capsys: Capsys, tmp_path: Path, arch: str
) -> None:
    data = write_data(tmp_path / "data.jsonl", 8)
    losses = {}
    for layout in ("hub", "fused"):
        model = make_model(tmp_path, arch, tied=False, per_expert=layout == "hub")
        out = tmp_path / f"out-{layout}"
        config = write_config(tmp_path / f"{layout}.yaml", model, data, out,
                              train={"max_steps": 2})  # fmt: skip
        code, _, err = run(capsys, "train", str(config))
        assert code == 0, err
        losses[layout] = [(m["loss"], m.get("aux_loss")) for m in read_metrics(out)]
    # the same masters, the same math: the same numbers, not merely close ones
    assert losses["hub"] == losses["fused"]
    assert len(losses["hub"]) == 2
    assert all(aux is not None for _, aux in losses["hub"])

    # export writes the model's fused layout, which transformers loads unchanged
    code, _, err = run(capsys, "export", str(tmp_path / "out-hub"), str(tmp_path / "hf"))
    assert code == 0, err
    exported = load_file(tmp_path / "hf" / "model.safetensors")
    assert any(n.endswith("experts.gate_up_proj") for n in exported)
    loaded = AutoModelForCausalLM.from_pretrained(tmp_path / "hf", dtype=torch.float32)
    theirs = dict(loaded.named_parameters())
    assert exported.keys() == theirs.keys()
    assert all(torch.equal(exported[n], theirs[n].detach()) for n in exported)
    trained, _ = _masters(tmp_path / "hf")  # and slidedp reads it back as it wrote it
    assert all(torch.equal(trained[n], exported[n]) for n in exported)


def _refused(capsys: Capsys, tmp_path: Path, model: Path, verb: str, *needles: str) -> None:
    """``slidedp VERB``: exit 2, one line with ``needles``, nothing written anywhere."""
    data = write_data(tmp_path / "data.jsonl", 8)
    out = tmp_path / "out"
    config = write_config(tmp_path / "c.yaml", model, data, out)
    assert yaml.safe_load(config.read_text())["output"]["dir"] == str(out)
    before = snapshot(tmp_path)
    code, _, err = run(capsys, verb, str(config))
    assert code == 2, err
    one_error_line(err, verb, *needles)
    assert snapshot(tmp_path) == before
    assert not out.exists()


def _edit(model: Path, edit: dict[str, torch.Tensor | None]) -> None:
    weights = load_file(model / "model.safetensors")
    for name, tensor in edit.items():
        if tensor is None:
            del weights[name]
        else:
            weights[name] = tensor
    save_file(weights, model / "model.safetensors", metadata={"format": "pt"})


@pytest.mark.parametrize("verb", ["validate", "train"])
def test_a_missing_expert_is_named(capsys: Capsys, tmp_path: Path, verb: str) -> None:
    model = make_model(tmp_path, "qwen3_moe", tied=False, per_expert=True)
    _edit(model, {"model.layers.0.mlp.experts.5.up_proj.weight": None})
    _refused(
        capsys, tmp_path, model, verb,
        "weights missing from the model's safetensors files: "
        "model.layers.0.mlp.experts.5.up_proj.weight (1 of them)", "re-download the model",
    )  # fmt: skip


def test_a_missing_layer_of_experts_is_named_per_expert(capsys: Capsys, tmp_path: Path) -> None:
    model = make_model(tmp_path, "mixtral", tied=False, per_expert=True)
    prefix = "model.layers.1.block_sparse_moe.experts"
    _edit(model, {f"{prefix}.{e}.w2.weight": None for e in range(4)})
    _refused(capsys, tmp_path, model, "train", f"{prefix}.0.w2.weight", "(4 of them)")


@pytest.mark.parametrize("where", ["another layer", "the same layer"])
def test_mixed_layouts_are_refused(capsys: Capsys, tmp_path: Path, where: str) -> None:
    model = make_model(tmp_path, "olmoe", tied=False, per_expert=True)
    fused = load_file(make_model(tmp_path, "olmoe", tied=False) / "model.safetensors")
    down = "model.layers.1.mlp.experts.down_proj"
    edit: dict[str, torch.Tensor | None] = {down: fused[down]}
    if where == "another layer":  # layer 1's down_proj fused, its experts' removed
        edit |= {f"model.layers.1.mlp.experts.{e}.down_proj.weight": None for e in range(12)}
    _edit(model, edit)
    _refused(
        capsys, tmp_path, model, "train",
        f"the checkpoint mixes two expert layouts: '{down}' (model.safetensors) holds all "
        "experts fused, 'model.layers.0.mlp.experts.0.down_proj.weight' (model.safetensors) one "
        "expert", "keep one layout",
    )  # fmt: skip


def test_a_tensor_in_both_names_is_refused(capsys: Capsys, tmp_path: Path) -> None:
    model = make_model(tmp_path, "mixtral", tied=False, per_expert=True)
    router = load_file(model / "model.safetensors")["model.layers.0.block_sparse_moe.gate.weight"]
    _edit(model, {"model.layers.0.mlp.gate.weight": router})  # Mixtral's router, renamed too
    _refused(
        capsys, tmp_path, model, "validate",
        "'model.layers.0.block_sparse_moe.gate.weight' (model.safetensors) and "
        "'model.layers.0.mlp.gate.weight' (model.safetensors) are both "
        "'model.layers.0.mlp.gate.weight'; the checkpoint holds it twice",
    )  # fmt: skip


def test_a_mis_shaped_expert_is_refused(capsys: Capsys, tmp_path: Path) -> None:
    model = make_model(tmp_path, "qwen3_moe", tied=False, per_expert=True)
    _edit(model, {"model.layers.0.mlp.experts.7.gate_proj.weight": torch.zeros(32, 65)})
    _refused(
        capsys, tmp_path, model, "train",
        "'model.layers.0.mlp.experts.7.gate_proj.weight' has shape (32, 65), the model's "
        "config.json expects (32, 64)",
    )  # fmt: skip


def test_an_expert_past_the_config_is_refused(capsys: Capsys, tmp_path: Path) -> None:
    model = make_model(tmp_path, "mixtral", tied=False, per_expert=True)
    _edit(model, {"model.layers.0.block_sparse_moe.experts.4.w1.weight": torch.zeros(128, 64)})
    _refused(
        capsys, tmp_path, model, "train",
        "tensor 'model.layers.0.block_sparse_moe.experts.4.w1.weight' is not a parameter",
    )  # fmt: skip
