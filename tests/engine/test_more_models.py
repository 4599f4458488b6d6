"""Mixture-of-experts and Gemma 3 layers, model config overrides (CPU, float32).

A MoE layer has an extra output, its router logits, whose gradient (from the load-balancing
loss) joins the output's in the backward: every family that applies must still give full
checkpointing's numbers bit for bit (``torch.equal``, as tests/engine/test_activations.py), the
extra output and its gradient included. Layouts and runs that cannot apply are refused before
anything is written, in one line.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
from transformers.models.mixtral import modeling_mixtral
from transformers.models.mixtral.modeling_mixtral import load_balancing_loss_func as mixtral_loss

from cli.util import one_error_line, run, snapshot
from engine.tiny import make_model, read_metrics, tiny_config, write_config, write_data
from slidedp.models.hf import HFAdapter
from slidedp.plan.layout import parse_entry
from slidedp.runtime.activations import LayerRun, executor_for
from slidedp.runtime.activations.offload import ActivationOffload, offload_count
from slidedp.runtime.lanes import LaneClock

CPU = torch.device("cpu")
Capsys = pytest.CaptureFixture[str]


def _moe_layer(arch: str) -> tuple[HFAdapter, torch.Tensor, dict[str, torch.Tensor], Any]:
    adapter = HFAdapter(tiny_config(arch, tied=False, layers=1))
    torch.manual_seed(0)
    group = adapter.groups[adapter.layer_group(0)]
    shapes = adapter.shapes()
    params = {local: torch.randn(shapes[full]) * 0.1 for full, local in group.params}
    x = torch.randn(2, 12, 64)
    position_ids = torch.arange(12).unsqueeze(0)
    padding = torch.ones(2, 12, dtype=torch.long)
    padding[1, 9:] = 0
    ctx = {
        "position_ids": position_ids,
        "position_embeddings": adapter.position_embeddings(
            adapter.make_rotary(CPU), x, position_ids
        ),
        "masks": adapter.layer_masks(x, padding, position_ids),
    }
    return adapter, x, params, ctx


def _run(arch: str, text: str) -> list[torch.Tensor]:
    adapter, x, params, ctx = _moe_layer(arch)
    _, policy = parse_entry(text, 0.0)
    executor = executor_for(policy)
    y, state = executor.forward(LayerRun(adapter, 0, params, ctx), x)
    (logits,) = state.extra  # one router
    offload = ActivationOffload(CPU, LaneClock(CPU))
    offload.offload(0, state, offload_count(state.saved_bytes(), policy.ratio))
    backward_params = {n: p.clone() for n, p in params.items()}
    for p in params.values():
        p.fill_(float("nan"))  # the window overwrites the forward's slot
    offload.reload(0, state)
    g = torch.linspace(-1, 1, y.numel()).view_as(y)
    g_logits = torch.linspace(1, -1, logits.numel()).view_as(logits)
    g_x, grads = executor.backward(
        LayerRun(adapter, 0, backward_params, ctx), state, g, (g_logits,)
    )
    assert grads["mlp.gate.weight"].abs().sum() > 0
    assert g_x is not None
    return [y, logits, g_x, *(grads[n] for n in sorted(grads))]


@pytest.mark.e2e
@pytest.mark.parametrize("arch", ["qwen3_moe", "mixtral"])
@pytest.mark.parametrize("family", ["N", "N-r1", "SAC.mm", "SAC.attn-r0.5", "F-r1"])
def test_a_moe_layer_with_router_logits_is_bit_identical_in_every_family(
    arch: str, family: str
) -> None:
    full = _run(arch, "F")
    other = _run(arch, family)
    assert all(torch.isfinite(t).all() for t in other), "read the overwritten slot"
    assert all(torch.equal(a, b) for a, b in zip(full, other, strict=True))


def test_the_router_logits_gradient_reaches_the_router() -> None:
    """The logits' gradient changes the router weight's (and, through the router's input,
    the attention's): it is not dropped on the way."""
    adapter, x, params, ctx = _moe_layer("qwen3_moe")
    executor = executor_for(parse_entry("F", 0.0)[1])
    y, state = executor.forward(LayerRun(adapter, 0, params, ctx), x)
    g = torch.ones_like(y)
    (logits,) = state.extra
    _, without = executor.backward(LayerRun(adapter, 0, params, ctx), state, g)
    _, state = executor.forward(LayerRun(adapter, 0, params, ctx), x)
    _, with_aux = executor.backward(
        LayerRun(adapter, 0, params, ctx), state, g, (torch.ones_like(logits),)
    )
    assert not torch.equal(without["mlp.gate.weight"], with_aux["mlp.gate.weight"])
    assert torch.equal(without["mlp.experts.down_proj"], with_aux["mlp.experts.down_proj"])


def _refused(
    capsys: Capsys, tmp_path: Path, model: Path, /, *needles: str, **sections: Any
) -> None:
    data = write_data(tmp_path / "data.jsonl", 8)
    out = tmp_path / "out"
    config = write_config(tmp_path / "c.yaml", model, data, out, **sections)
    code, _, err = run(capsys, "train", str(config))
    assert code == 2
    one_error_line(err, "train", *needles)
    assert snapshot(out) == {}


@pytest.mark.parametrize(
    ("arch", "layers", "needles"),
    [
        ("gemma3_text", "1xF, 1xS1010100", ("layer 1 is S1010100", "gemma3_text layer")),
        ("mixtral", "S0000001", ("layer 0 is S0000001", "mixtral layer")),
        ("qwen3_moe", "1xSAC.mm, 1xSAC.noact", ("layer 1 is SAC.noact", "qwen3_moe layer")),
    ],
)
def test_a_layout_that_does_not_apply_to_the_layer_is_a_config_error(
    capsys: Capsys, tmp_path: Path, arch: str, layers: str, needles: tuple[str, ...]
) -> None:
    model = make_model(tmp_path, arch, tied=False, layers=2)
    _refused(capsys, tmp_path, model, *needles, runtime={"layers": layers})


def _per_layer_mean(gate_logits: tuple[torch.Tensor, ...], *args: Any) -> Any:
    """A load-balancing loss that is not the pooled token means: each layer's, averaged."""
    return sum(mixtral_loss((g,), *args) for g in gate_logits) / len(gate_logits)


def test_several_ranks_refuse_a_load_balancing_loss_they_cannot_sum(
    capsys: Capsys, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Several ranks sum token statistics: a transformers whose function is another formula
    (here the mean of per-layer losses) is refused before anything is written."""
    monkeypatch.setattr(modeling_mixtral, "load_balancing_loss_func", _per_layer_mean)
    model = make_model(tmp_path, "mixtral", tied=False, layers=2)
    _refused(
        capsys, tmp_path, model, "is not the per-expert token means", "aux_loss",
        "output_router_logits=false", runtime={"ranks": 2},
    )  # fmt: skip


LONG = 160  # tokens: past the tiny models' max_position_embeddings (128)
YARN = {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 128}


def test_a_sequence_past_the_position_limit_is_refused_without_the_override(
    capsys: Capsys, tmp_path: Path
) -> None:
    model = make_model(tmp_path, "qwen3", tied=False, layers=2)
    _refused(
        capsys, tmp_path, model, "data.seq_len=160 exceeds", "max_position_embeddings=128",
        data={"seq_len": LONG},
    )  # fmt: skip


@pytest.mark.e2e
def test_rope_scaling_and_max_positions_train_past_the_native_limit(
    capsys: Capsys, tmp_path: Path
) -> None:
    model = make_model(tmp_path, "qwen3", tied=False, layers=2)
    data = write_data(tmp_path / "long.jsonl", 8, min_len=LONG - 8, max_len=LONG)
    out = tmp_path / "out"
    overrides = {"rope_scaling": YARN, "max_position_embeddings": 4 * 128}
    config = write_config(tmp_path / "c.yaml", model, data, out, data={"seq_len": LONG},
                          model=overrides, train={"max_steps": 2})  # fmt: skip
    code, _, err = run(capsys, "train", str(config))
    assert code == 0, err
    metrics = read_metrics(out)
    assert all(m["seq_len"] > 128 for m in metrics)  # past the native limit
    assert all(torch.isfinite(torch.tensor(m["loss"])) for m in metrics)
    # what the engine's rotary module computes with: transformers' YaRN
    rotary: Any = HFAdapter.from_dir(model, overrides).make_rotary(CPU)
    assert rotary.rope_type == "yarn"
    assert rotary.attention_scaling > 1.0  # YaRN's 0.1 ln(factor) + 1
    native: Any = HFAdapter.from_dir(model).make_rotary(CPU)
    assert native.rope_type == "default"
    assert not torch.equal(rotary.inv_freq, native.inv_freq)


def test_a_bad_rope_scaling_is_one_line(capsys: Capsys, tmp_path: Path) -> None:
    model = make_model(tmp_path, "qwen3", tied=False, layers=2)
    _refused(capsys, tmp_path, model, "model.rope_scaling needs rope_type",
             model={"rope_scaling": {"factor": 4.0}})  # fmt: skip


@pytest.mark.parametrize(
    ("rope", "needle"),
    [
        ({"rope_type": "bogus", "factor": 4.0}, "rope_type 'bogus' is not one transformers knows"),
        ({"rope_type": "linear", "factor": 0}, "factor must be a number >= 1 (how many times"),
        ({"rope_type": "yarn", "factor": 0.5}, "factor must be a number >= 1"),
        ({"rope_type": "linear", "factor": "abc"}, "factor must be a number >= 1"),
    ],
)
def test_a_rope_scaling_transformers_only_warns_about_is_refused(
    capsys: Capsys, tmp_path: Path, rope: dict[str, Any], needle: str
) -> None:
    """transformers logs these and builds the model (a factor 0 trained to NaN, 0.5 trained
    on): validate and train refuse them in one line, nothing written."""
    model = make_model(tmp_path, "qwen3", tied=False, layers=2)
    _refused(capsys, tmp_path, model, "model.rope_scaling's " + needle,
             model={"rope_scaling": rope})  # fmt: skip


def test_yarn_without_its_original_length_scales_from_the_models_own(tmp_path: Path) -> None:
    """Given with model.max_position_embeddings, YaRN's pretraining length is the model's 128,
    not the overridden 512 transformers would take (a silently different rotary frequency)."""
    path = make_model(tmp_path, "qwen3", tied=False, layers=2)
    implicit = {"rope_type": "yarn", "factor": 4.0}
    given: Any = HFAdapter.from_dir(path, {"rope_scaling": YARN, "max_position_embeddings": 512})
    filled: Any = HFAdapter.from_dir(path, {"rope_scaling": implicit,
                                            "max_position_embeddings": 512})  # fmt: skip
    assert filled.config.rope_parameters["original_max_position_embeddings"] == 128
    assert torch.equal(filled.make_rotary(CPU).inv_freq, given.make_rotary(CPU).inv_freq)
