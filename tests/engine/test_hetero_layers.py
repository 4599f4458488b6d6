"""Models whose decoder layers differ (CPU, float32): Gemma 4 text and Qwen3.5-MoE text.

Gemma 4's full-attention layers have a wider head (``global_head_dim``) and share keys and
values (``attention_k_eq_v``: no ``v_proj``), and every layer carries a ``layer_scalar``
buffer (with ``enable_moe_block`` also experts beside its MLP; transformers adds no
load-balancing loss for them). Qwen3.5-MoE mixes Gated DeltaNet linear-attention layers
(other parameters, a recurrent state) with gated full attention, every layer a mixture of
experts with a shared expert and the load-balancing loss. Each layer is bound to its own
module and its own store group; the window's slots hold the largest. ``slidedp train``
matches the plain PyTorch reference trainer (tests/engine/tiny.py) as tests/engine/
test_parity.py does; what the engine cannot stream is refused in one line before anything is
written.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors.torch import load_file, save_file
from transformers import AutoConfig, Gemma4Config
from transformers.models.qwen3_5_moe import Qwen3_5MoeConfig

from engine.test_more_models import _refused
from engine.tiny import (
    make_model,
    read_metrics,
    reference_train,
    tiny_config,
    write_config,
    write_data,
)
from slidedp.cli import main
from slidedp.models.hf import HFAdapter
from slidedp.models.shape import layer_shapes
from slidedp.plan.cost import layer_footprint, layout_memory
from slidedp.plan.layout import parse_entry

Capsys = pytest.CaptureFixture[str]

# Tolerances (float32, measured over these 8 steps). Losses: <= 3e-7 relative, and the first
# two steps' losses and grad norms equal to 1e-7 (the same math in another summation order, as
# in test_parity.py), so 1e-5 and, before any update, 1e-6: a wrong mask, buffer, rotary or aux
# loss changes step 1 by >= 1e-4. Later grad norms: the tiny Gemma 4 amplifies rounding more
# than the other models (at lr 3e-3 it spikes to twice its grad norm, and there 3e-4 apart; it
# trains at 1e-3 here): slidedp against itself with only loss_chunk_tokens changed (a
# summation order) differs by 8e-6 in grad norm; against the reference <= 2.7e-5 (Gemma 4
# with experts; Qwen3.5 7.5e-8), so 1e-4.
# Parameters: <= 7.3e-6 absolute, so 1e-5 (a missed clip or a wrong decay set moves them by
# >= 1e-4), but for a few of Gemma 4's embedding entries (0 or 1 of 16,384 measured): an entry
# whose gradient nearly cancels takes Adam steps whose size and sign follow the rounding, up
# to a learning rate per step; at most 8 such entries, each within 2 x lr.
LOSS_RTOL = 1e-5
FIRST_STEPS_RTOL = 1e-6
NORM_RTOL = 1e-4
PARAM_ATOL = 1e-5
SIGN_ENTRIES = 8

# (architecture, tied embeddings, max_grad_norm binding in some steps, transfer chunk, layout)
CASES = [
    ("gemma4_text", False, 11.0, 0, "F"),
    ("gemma4_text", True, 11.0, 1000, "1xN-r1, 1xSAC.mm, 1xF"),
    ("gemma4_text_moe", False, 14.0, 0, "F"),
    ("gemma4_text_moe", True, 14.0, 1000, "1xSAC.attn-r1, 1xN, 1xF"),
    ("qwen3_5_moe_text", False, 1.6, 0, "F"),
    ("qwen3_5_moe_text", True, 1.6, 1000, "1xSAC.attn-r1, 1xN, 1xF"),
]
LR = {"gemma4_text": 1e-3, "gemma4_text_moe": 1e-3, "qwen3_5_moe_text": 3e-3}


def _train(arch: str, max_grad_norm: float) -> dict[str, Any]:
    return {
        "max_steps": 8,
        "global_batch_size": 4,
        "learning_rate": LR[arch],
        "weight_decay": 0.1,
        "lr_scheduler": "cosine",
        "warmup_steps": 3,
        "max_grad_norm": max_grad_norm,
    }


def test_the_tiny_models_mix_layers_of_two_kinds() -> None:
    """What the parity runs stream: layers whose parameters differ, in both orders."""
    for arch in ("gemma4_text", "gemma4_text_moe", "qwen3_5_moe_text"):
        adapter = HFAdapter(tiny_config(arch, tied=False, layers=3))
        assert adapter.layer_kinds == ([0, 1, 0] if arch == "qwen3_5_moe_text" else [0, 0, 2])
        sizes = {sum(p.numel() for p in adapter.layer_module(k).parameters())
                 for k in set(adapter.layer_kinds)}  # fmt: skip
        assert len(sizes) == 2


def test_flops_and_the_cost_model_take_each_layer_as_its_kind() -> None:
    """Gemma 4's full-attention layer has twice the head dimension (and saves more for the
    backward); Qwen3.5's linear-attention layers have no softmax attention to count."""
    gemma = HFAdapter(tiny_config("gemma4_text", tied=False, layers=3))
    shapes = layer_shapes(gemma.config, seq_len=32)
    assert [(s.q_dim, s.kv_dim, s.attended) for s in shapes] == [(32, 16, 8)] * 2 + [(64, 16, 32)]
    qwen = tiny_config("qwen3_5_moe_text", tied=False, layers=3)
    assert [s.q_dim for s in layer_shapes(qwen, seq_len=32)] == [0, 64, 0]
    _, policy = parse_entry("N", 0.0)
    sliding, full = (layer_footprint(gemma, policy, 2, 32, torch.bfloat16, i) for i in (0, 2))
    assert full.retained_bytes > sliding.retained_bytes
    memory = layout_memory(gemma, [policy] * 3, 2, 32, torch.bfloat16)
    assert memory.retained_bytes == 2 * sliding.retained_bytes + full.retained_bytes


@pytest.mark.e2e
@pytest.mark.parametrize(("arch", "tied", "max_grad_norm", "chunk", "layers"), CASES)
def test_losses_and_final_params_match_the_reference(
    tmp_path: Path, arch: str, tied: bool, max_grad_norm: float, chunk: int, layers: str
) -> None:
    model = make_model(tmp_path, arch, tied=tied, layers=3)
    data = write_data(tmp_path / "data.jsonl", 30)
    train = _train(arch, max_grad_norm)
    out = tmp_path / "out"
    runtime = {"chunk_elems": chunk, "grad_slots": 2 if chunk else 4, "layers": layers}
    config = write_config(tmp_path / "c.yaml", model, data, out, train=train, runtime=runtime)
    assert main(["train", str(config)]) == 0

    ref = reference_train(model, data, train)
    metrics = read_metrics(out)
    losses = torch.tensor([m["loss"] for m in metrics], dtype=torch.float64)
    norms = torch.tensor([m["grad_norm"] for m in metrics], dtype=torch.float64)
    ref_losses = torch.tensor(ref.losses, dtype=torch.float64)
    ref_norms = torch.tensor(ref.grad_norms, dtype=torch.float64)
    torch.testing.assert_close(losses, ref_losses, rtol=LOSS_RTOL, atol=0)
    torch.testing.assert_close(norms[:2], ref_norms[:2], rtol=FIRST_STEPS_RTOL, atol=0)
    torch.testing.assert_close(losses[:2], ref_losses[:2], rtol=FIRST_STEPS_RTOL, atol=0)
    torch.testing.assert_close(norms, ref_norms, rtol=NORM_RTOL, atol=0)
    aux = [m["aux_loss"] for m in metrics if "aux_loss" in m]  # Gemma 4 MoE: none
    assert len(aux) == len(ref.aux_losses) == (8 if arch == "qwen3_5_moe_text" else 0)
    torch.testing.assert_close(
        torch.tensor(aux), torch.tensor(ref.aux_losses), rtol=LOSS_RTOL, atol=0
    )
    clipped = [m["clip_coef"] < 1.0 for m in metrics]
    assert any(clipped), "max_grad_norm must bind in some steps for the test to mean anything"
    assert not all(clipped), "and leave others unclipped"

    final = load_file(out / "final" / "model.safetensors")
    expected = set(ref.params) - ({"lm_head.weight"} if tied else set())
    assert set(final) == expected  # Gemma 4's layer_scalar buffers included
    diffs = {n: (final[n] - ref.params[n]).abs() for n in final}
    embed = diffs.pop("model.embed_tokens.weight")
    worst = max(d.max().item() for d in diffs.values())
    rel = ((norms - ref_norms).abs() / ref_norms).max().item()
    past = int((embed > PARAM_ATOL).sum())
    print(f"{arch} tied={tied}: max rel |dnorm| {rel:.1e}, max |dparam| {worst:.2e} "
          f"(embedding {embed.max():.2e}, {past} entries past {PARAM_ATOL})")  # fmt: skip
    assert worst <= PARAM_ATOL
    assert past <= SIGN_ENTRIES
    assert embed.max().item() <= 2 * LR[arch]


@pytest.mark.e2e
def test_a_resumed_gemma4_run_continues_with_the_checkpoints_layer_buffers(
    tmp_path: Path,
) -> None:
    """The checkpoint carries the layer buffers (not 1 here); the resumed run reads them back
    from it, not from the model directory (its weights removed here), and repeats the
    uninterrupted run's steps exactly."""
    model = make_model(tmp_path, "gemma4_text", tied=True, layers=3)
    data = write_data(tmp_path / "data.jsonl", 16)
    train = {"max_steps": 4, "max_grad_norm": 8.0}
    config = write_config(tmp_path / "c.yaml", model, data, tmp_path / "full", train=train)
    assert main(["train", str(config), "output.save_steps=2"]) == 0
    checkpoint = tmp_path / "full" / "checkpoint-2"
    scalars = {n: t for n, t in load_file(checkpoint / "model.safetensors").items()
               if n.endswith("layer_scalar")}  # fmt: skip
    assert [float(t) for t in scalars.values()] == [0.5, 0.75, 1.0]
    (model / "model.safetensors").unlink()  # the model directory's buffers would be 1
    resumed = ["output.dir=" + str(tmp_path / "resumed"), f"train.resume={checkpoint}"]
    assert main(["train", str(config), *resumed]) == 0
    full = read_metrics(tmp_path / "full")
    again = read_metrics(tmp_path / "resumed")
    assert [m["step"] for m in again] == [3, 4]
    assert [m["loss"] for m in again] == [m["loss"] for m in full[2:]]


def _with_config(model: Path, **fields: Any) -> Path:
    """``model`` with ``fields`` changed in its config.json and no weights (seeded init)."""
    config = json.loads((model / "config.json").read_text()) | fields
    (model / "config.json").write_text(json.dumps(config))
    (model / "model.safetensors").unlink()
    return model


@pytest.mark.parametrize(
    ("fields", "needles"),
    [
        ({"hidden_size_per_layer_input": 8, "vocab_size_per_layer_input": 256},
         ("per-layer input embeddings", "hidden_size_per_layer_input=8")),
        ({"num_kv_shared_layers": 1}, ("shared across layers", "num_kv_shared_layers=1")),
    ],
)  # fmt: skip
def test_what_a_gemma4_layer_cannot_stream_is_refused(
    capsys: Capsys, tmp_path: Path, fields: dict[str, Any], needles: tuple[str, ...]
) -> None:
    model = _with_config(make_model(tmp_path, "gemma4_text", tied=True, layers=3), **fields)
    _refused(capsys, tmp_path, model, *needles)


def test_sac_noact_on_a_gemma4_layer_with_experts_is_refused(
    capsys: Capsys, tmp_path: Path
) -> None:
    model = make_model(tmp_path, "gemma4_text_moe", tied=False, layers=3)
    _refused(capsys, tmp_path, model, "layer 1 is SAC.noact", "gemma4_text layer",
             runtime={"layers": "1xF, 1xSAC.noact, 1xF"})  # fmt: skip


def _multimodal(text_dir: Path, arch: str) -> Path:
    """The multimodal model around the text model of ``text_dir``: its config as
    ``text_config``, its weights under ``model.language_model.`` beside a vision tensor."""
    text = AutoConfig.from_pretrained(text_dir)
    kind = {"gemma4_text": Gemma4Config, "qwen3_5_moe_text": Qwen3_5MoeConfig}[arch]
    top = kind(text_config=text.to_dict(), tie_word_embeddings=text.tie_word_embeddings)
    out = text_dir.with_name(text_dir.name + "-multimodal")
    top.save_pretrained(out)
    prefix = "model.language_model."
    tensors = {(prefix + n.removeprefix("model.") if n.startswith("model.") else n): t
               for n, t in load_file(text_dir / "model.safetensors").items()}  # fmt: skip
    tensors["model.vision_tower.patch_embedder.weight"] = torch.ones(4, 4)  # not the text's
    save_file(tensors, out / "model.safetensors", metadata={"format": "pt"})
    return out


@pytest.mark.e2e
@pytest.mark.parametrize(("arch", "tied"), [("gemma4_text", True), ("qwen3_5_moe_text", False)])
def test_a_multimodal_directory_trains_its_text_model(
    tmp_path: Path, arch: str, tied: bool
) -> None:
    """The same run as from the text model's own directory, bit for bit; the checkpoints and
    the export are the text model's."""
    text = make_model(tmp_path, arch, tied=tied, layers=3)
    data = write_data(tmp_path / "data.jsonl", 12)
    runs = {}
    for name, model in (("text", text), ("multimodal", _multimodal(text, arch))):
        out = tmp_path / name
        config = write_config(tmp_path / f"{name}.yaml", model, data, out)
        assert main(["train", str(config)]) == 0
        runs[name] = (read_metrics(out), load_file(out / "final" / "model.safetensors"))
        exported = json.loads((out / "final" / "config.json").read_text())
        assert exported["model_type"] == arch
        assert exported["tie_word_embeddings"] is tied
    (m1, p1), (m2, p2) = runs["text"], runs["multimodal"]
    assert [m["loss"] for m in m1] == [m["loss"] for m in m2]
    assert set(p1) == set(p2)
    assert all(torch.equal(p1[n], p2[n]) for n in p1)


def test_packed_rows_through_linear_attention_are_refused(capsys: Capsys, tmp_path: Path) -> None:
    model = make_model(tmp_path, "qwen3_5_moe_text", tied=False, layers=3)
    _refused(capsys, tmp_path, model, "data.packing=true", "linear-attention layers",
             "data.packing=false", data={"packing": True})  # fmt: skip


def test_sac_noact_on_a_gemma4_layer_is_refused(capsys: Capsys, tmp_path: Path) -> None:
    """Its output is scaled in place (``layer_scalar``) after the residual add SAC.noact keeps:
    torch refuses the mutated cache entry at the replay."""
    model = make_model(tmp_path, "gemma4_text", tied=False, layers=3)
    _refused(capsys, tmp_path, model, "layer 2 is SAC.noact", "scales in place",
             runtime={"layers": "2xF, 1xSAC.noact"})  # fmt: skip


def _as_in_transformers_5_17(monkeypatch: pytest.MonkeyPatch, arch: str) -> None:
    """What the GPU machine's transformers 5.17 does that 5.23 does not (found by the GPU
    parity test): Gemma 4's last layer of each attention type stores its keys and values in
    the forward's ``shared_kv_states`` dict even when no layer reuses them, and Qwen3.5's
    rotary reads position ids with a row per grid axis ([3, B, S]), as its model's forward
    passes them."""
    if arch.startswith("gemma4"):
        from transformers.models.gemma4 import modeling_gemma4 as gemma4

        init = gemma4.Gemma4TextAttention.__init__

        def storing(self: Any, *args: Any, **kwargs: Any) -> None:
            init(self, *args, **kwargs)
            self.store_full_length_kv = True

        monkeypatch.setattr(gemma4.Gemma4TextAttention, "__init__", storing)
    else:
        from transformers.models.qwen3_5_moe import modeling_qwen3_5_moe as qwen

        forward = qwen.Qwen3_5MoeTextRotaryEmbedding.forward

        def by_axis(self: Any, x: torch.Tensor, position_ids: torch.Tensor) -> Any:
            assert position_ids.ndim == 3, "a row of position ids per grid axis"
            return forward(self, x, position_ids)

        monkeypatch.setattr(qwen.Qwen3_5MoeTextRotaryEmbedding, "forward", by_axis)


@pytest.mark.e2e
@pytest.mark.parametrize("arch", ["gemma4_text", "qwen3_5_moe_text"])
def test_layers_run_alone_as_the_models_forward_calls_them(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path, arch: str
) -> None:
    """Each layer gets what its model's forward gives it (a key/value dict to write, position
    ids per grid axis), so the losses stay the reference's under the older transformers."""
    model = make_model(tmp_path, arch, tied=False, layers=3)
    data = write_data(tmp_path / "data.jsonl", 30)
    train = {**_train(arch, 0.0), "max_steps": 2}
    ref = reference_train(model, data, train)
    _as_in_transformers_5_17(monkeypatch, arch)
    out = tmp_path / "out"
    config = write_config(tmp_path / "c.yaml", model, data, out, train=train)
    assert main(["train", str(config)]) == 0
    losses = [m["loss"] for m in read_metrics(out)]
    torch.testing.assert_close(losses, ref.losses, rtol=FIRST_STEPS_RTOL, atol=0)
