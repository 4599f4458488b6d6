"""The training loop's contract: export, metrics, offload, slots, init, errors (CPU)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors.torch import load_file, save_file
from transformers import AutoModelForCausalLM

from engine.tiny import make_model, read_metrics, write_config, write_data
from slidedp.cli import main
from slidedp.config import load_config
from slidedp.errors import NonFiniteError
from slidedp.plan import machine
from slidedp.runtime.trainer import Trainer

pytestmark = pytest.mark.e2e  # every test here trains end to end

LANE_KEYS = ("h2d_s", "compute_s", "d2h_s", "update_s", "offload_s", "wait_h2d_s", "wait_update_s")


def _run(tmp_path: Path, model: Path, name: str, **sections: dict[str, object]) -> Path:
    data = write_data(tmp_path / "data.jsonl", 16)
    out = tmp_path / name
    config = write_config(tmp_path / f"{name}.yaml", model, data, out, **sections)
    assert main(["train", str(config)]) == 0
    return out


def test_export_loads_in_transformers_and_equals_the_master_weights(tmp_path: Path) -> None:
    model = make_model(tmp_path, "qwen3", tied=True)
    data = write_data(tmp_path / "data.jsonl", 16)
    config = write_config(tmp_path / "c.yaml", model, data, tmp_path / "out")
    trainer = Trainer(load_config(config), log=False)
    trainer.run()
    exported = AutoModelForCausalLM.from_pretrained(tmp_path / "out" / "final")
    assert exported.lm_head.weight is exported.model.embed_tokens.weight
    state = exported.state_dict()
    for _, name in trainer.adapter.iter_params():
        assert torch.equal(state[name], trainer.store.param(name)), name
    original = AutoModelForCausalLM.from_pretrained(model)
    assert not torch.equal(original.model.norm.weight, exported.model.norm.weight)  # it trained


def test_metrics_have_one_line_per_step_with_lanes_and_waits(tmp_path: Path) -> None:
    model = make_model(tmp_path, "llama", tied=False)
    out = _run(tmp_path, model, "out", train={"max_steps": 4})
    metrics = read_metrics(out)
    assert [m["step"] for m in metrics] == [1, 2, 3, 4]
    for m in metrics:
        for key in ("loss", "grad_norm", "lr", "tokens", "step_time_s", *LANE_KEYS):
            assert isinstance(m[key], float | int), key
        assert m["tokens"] > 0
        assert m["compute_s"] > 0
    assert metrics[0]["lr"] == pytest.approx(1e-3)  # linear, no warmup: full lr at step 1
    assert metrics[-1]["lr"] < metrics[0]["lr"]


def test_offload_and_a_single_slot_give_the_same_losses(tmp_path: Path) -> None:
    model = make_model(tmp_path, "qwen3", tied=False, layers=3)
    base = read_metrics(_run(tmp_path, model, "r0"))
    offloaded = read_metrics(_run(tmp_path, model, "r1", runtime={"offload_ratio": 1}))
    one_slot = read_metrics(_run(tmp_path, model, "s1", runtime={"slots": 1}))
    losses = [m["loss"] for m in base]
    assert [m["loss"] for m in offloaded] == losses  # the same values, copied out and back
    assert [m["loss"] for m in one_slot] == losses
    assert all(m["offload_s"] > 0 for m in offloaded)


def test_without_weight_files_the_model_is_initialised_from_the_config(tmp_path: Path) -> None:
    model = make_model(tmp_path, "qwen3", tied=True)
    (model / "model.safetensors").unlink()
    data = write_data(tmp_path / "data.jsonl", 16)
    config = write_config(tmp_path / "c.yaml", model, data, tmp_path / "out")
    a = Trainer(load_config(config, ["output.export=false"]), log=False)
    b = Trainer(load_config(config, ["output.export=false"]), log=False)
    std = a.adapter.config.initializer_range
    w = a.store.param("model.layers.1.mlp.up_proj.weight")
    assert w.std().item() == pytest.approx(std, rel=0.1)
    assert torch.equal(a.store.param("model.norm.weight"), torch.ones(64))
    assert torch.equal(w, b.store.param("model.layers.1.mlp.up_proj.weight"))  # seeded
    records = a.run()
    assert records[-1]["loss"] < records[0]["loss"] + 0.1


def test_without_clipping_a_non_finite_layer_gradient_stops_before_its_update(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from slidedp.runtime.activations.full import FullExecutor

    backward = FullExecutor.backward

    def poisoned(self: FullExecutor, run: Any, *args: Any, **kwargs: Any) -> Any:
        g_x, grads = backward(self, run, *args, **kwargs)
        if run.layer == 0:  # the last layer of the backward: the others are sent by now
            grads = {n: torch.full_like(g, float("inf")) for n, g in grads.items()}
        return g_x, grads

    monkeypatch.setattr(FullExecutor, "backward", poisoned)
    model = make_model(tmp_path, "qwen3", tied=True)
    data = write_data(tmp_path / "data.jsonl", 16)
    config = write_config(tmp_path / "c.yaml", model, data, tmp_path / "out",
                          train={"max_grad_norm": 0.0})  # fmt: skip
    trainer = Trainer(load_config(config), log=False)
    layer0 = trainer.adapter.layer_group(0)
    before = trainer.store.group_state(layer0, "master").clone()
    with pytest.raises(NonFiniteError, match=r"the gradient of 'layers\.0' is not finite"):
        trainer.run()
    trainer.engine.drain()
    assert torch.equal(trainer.store.group_state(layer0, "master"), before)  # not updated
    assert trainer.store.version(trainer.adapter.layer_group(1)) == 1  # sent before it: updated


def test_a_non_finite_loss_stops_before_any_update(tmp_path: Path) -> None:
    model = make_model(tmp_path, "llama", tied=False)
    weights = load_file(model / "model.safetensors")
    weights["model.norm.weight"][0] = float("nan")
    save_file(weights, model / "model.safetensors", metadata={"format": "pt"})
    data = write_data(tmp_path / "data.jsonl", 16)
    config = write_config(tmp_path / "c.yaml", model, data, tmp_path / "out")
    trainer = Trainer(load_config(config), log=False)
    before = trainer.store.region("master").clone()
    with pytest.raises(NonFiniteError, match="loss is not finite") as info:
        trainer.run()
    assert info.value.step == 0
    trainer.engine.drain()
    after = trainer.store.region("master")
    assert torch.equal(before.view(torch.int32), after.view(torch.int32))  # bitwise, NaN too
    assert not trainer.store.region("exp_avg").any()
    assert all(trainer.store.version(g) == 0 for g in range(trainer.store.num_groups))


def test_text_lines_are_tokenized_with_the_model_tokenizer(tmp_path: Path) -> None:
    pytest.importorskip("tokenizers")
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    model = make_model(tmp_path, "qwen3", tied=True)
    vocab = {f"w{i}": i for i in range(250)} | {"[UNK]": 250}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="[UNK]")  # type: ignore[no-untyped-call]
    fast.save_pretrained(model)
    data = tmp_path / "text.jsonl"
    data.write_text(
        "".join(json.dumps({"text": f"w{i} w{i + 1} w{i + 2} w7"}) + "\n" for i in range(8))
    )
    config = write_config(tmp_path / "c.yaml", model, data, tmp_path / "out")
    trainer = Trainer(load_config(config, ["output.export=false"]), log=False)
    assert trainer.data.batch(0).input_ids[0].tolist() == [0, 1, 2, 7]
    assert len(trainer.run()) == 3


def test_bfloat16_compute_on_cpu_tracks_float32(tmp_path: Path) -> None:
    """The BF16 path (Rust cast into staging, bf16 window and host gradients) end to end."""
    model = make_model(tmp_path, "qwen3", tied=True, layers=3)
    f32 = read_metrics(_run(tmp_path, model, "f32", train={"max_steps": 4}))
    bf16 = read_metrics(_run(tmp_path, model, "bf16", train={"max_steps": 4, "dtype": "bfloat16"}))
    for a, b in zip(f32, bf16, strict=True):
        # bf16 keeps 8 mantissa bits: per-op relative error ~4e-3, loss ~5.5 → |Δ| ~1e-2 at most
        assert abs(a["loss"] - b["loss"]) < 2e-2


@pytest.mark.parametrize("max_grad_norm", [0.0, 2.4])
def test_the_bf16_mirror_trains_bit_for_bit_like_casting_on_delivery(
    tmp_path: Path, max_grad_norm: float
) -> None:
    """``runtime.bf16_mirror``: AdamW writes the BF16 copy that the loads then send as is; it is
    the same rounding as the cast on delivery, so every loss, norm and master weight is equal
    (BF16 compute on CPU, groups split into several chunks, with and without clipping)."""
    model = make_model(tmp_path, "qwen3", tied=True, layers=3)
    data = write_data(tmp_path / "data.jsonl", 24)
    train = {"max_steps": 5, "dtype": "bfloat16", "max_grad_norm": max_grad_norm}
    runs = {}
    for mirror in (False, True):
        runtime = {"bf16_mirror": mirror, "chunk_elems": 1000}
        config = write_config(tmp_path / f"{mirror}.yaml", model, data, tmp_path / f"o{mirror}",
                              train=train, runtime=runtime)  # fmt: skip
        trainer = Trainer(load_config(config, ["output.export=false"]), log=False)
        runs[mirror] = (trainer, [(r["loss"], r["grad_norm"]) for r in trainer.run()])
    (cast, cast_log), (mirrored, mirror_log) = runs[False], runs[True]
    assert not cast.store.has_mirror
    assert cast.store.layout.staging_slots > 0
    assert mirrored.store.has_mirror
    assert mirrored.store.layout.staging_slots == 0
    assert mirror_log == cast_log
    layout = mirrored.store.layout
    for p in layout.params:
        master = mirrored.store.param(p.name)
        assert torch.equal(master, cast.store.param(p.name)), p.name
        copy = mirrored.store.mirror_group(p.group)[p.slot_offset :][: p.numel]
        assert torch.equal(copy, master.view(-1).to(torch.bfloat16)), p.name


@pytest.mark.parametrize("available_gib", [64, 1])
def test_by_default_the_trainer_takes_the_mirror_where_the_host_has_room_for_it(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, available_gib: int
) -> None:
    """``runtime.bf16_mirror: null``: the store the trainer creates has the mirror when the run
    with it fits MemAvailable with 8 GiB to spare (``estimate.resolve_mirror``), else not."""
    monkeypatch.setattr(
        machine, "meminfo_bytes", lambda: {"mem_available_bytes": available_gib * 2**30}
    )
    model = make_model(tmp_path, "qwen3", tied=True, layers=2)
    data = write_data(tmp_path / "data.jsonl", 8)
    config = write_config(tmp_path / "c.yaml", model, data, tmp_path / "out",
                          train={"max_steps": 1, "dtype": "bfloat16"})  # fmt: skip
    trainer = Trainer(load_config(config, ["output.export=false"]), log=False)
    try:
        assert trainer.store.has_mirror == (available_gib == 64)
    finally:
        trainer.engine.close()
