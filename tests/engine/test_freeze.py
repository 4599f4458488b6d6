"""``train.freeze`` (CPU, float32) against a plain PyTorch trainer whose frozen parameters have
``requires_grad=False``: AdamW and clipping over the trained parameters only.

Tolerances: tests/engine/test_parity.py's, for the same reason (the same math in another
summation order: chunked loss, per-layer autograd, Rust AdamW), 1e-5 relative on losses and
grad norms, 1e-5 absolute on parameters. The frozen parameters are compared exactly: they must
leave the run bit for bit as they came in (an update, a decay or a moment applied to one moves
it by >= lr * weight_decay * |w| ~ 1e-6 at once, and by ~lr = 3e-3 once AdamW steps it).
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from engine.tiny import make_model, read_metrics, reference_train, write_config, write_data
from slidedp.cli import main
from slidedp.io.checkpoint import OPTIMIZER_DIR
from slidedp.models.freeze import Trained, frozen_names
from slidedp.models.hf import HFAdapter

pytestmark = pytest.mark.e2e  # every test here trains end to end

LOSS_RTOL = 1e-5
PARAM_ATOL = 1e-5
LAYER = (
    *(f"self_attn.{p}_proj.weight" for p in "qkvo"),
    *(f"mlp.{p}_proj.weight" for p in ("gate", "up", "down")),
    "input_layernorm.weight",
    "post_attention_layernorm.weight",
)


def layer_names(layers: range, arch: str) -> tuple[str, ...]:
    """Every parameter of decoder ``layers`` (Qwen3 adds its q/k norms)."""
    local = LAYER + (
        ("self_attn.q_norm.weight", "self_attn.k_norm.weight") if arch == "qwen3" else ()
    )
    return tuple(f"model.layers.{i}.{n}" for i in layers for n in local)


EMBED, HEAD, NORM = "model.embed_tokens.weight", "lm_head.weight", "model.norm.weight"
MLP = tuple(
    f"model.layers.{i}.mlp.{n}_proj.weight" for i in range(3) for n in ("gate", "up", "down")
)

# (architecture, tied, freeze patterns, the names they freeze, max_grad_norm, chunk, layout):
# the embedding alone (no embedding gradient); layers 0-1 with a trained embedding (their input
# gradients only) and with a frozen one (forward only: no backward below layer 2); the head
# (untied: no head weight gradient; tied: the embedding, and no gradient through it at all);
# parts of every layer (a group half frozen: its trained parameters first in the store); the
# final norm with the embedding. Chunk 1000 cuts each group into several gradient chunks. The
# clip thresholds sit inside each case's measured grad-norm range (frozen parts lower the norm:
# 1.2 .. 2.4 here), so that clipping binds in some steps only.
CASES = [
    ("qwen3", False, ["embed_tokens"], (EMBED,), 2.4, 0, "F"),
    ("llama", False, ["layers.0-1"], layer_names(range(2), "llama"), 1.8, 1000,
     "1xN-r0.5, 1xSAC.mm, 1xS1010100-r1"),
    ("qwen3", False, ["embed_tokens", "layers.0-1"], (EMBED, *layer_names(range(2), "qwen3")),
     0.0, 1000, "1xSAC.attn-r1, 1xN, 1xF"),
    ("qwen3", False, ["lm_head"], (HEAD,), 0.0, 1000, "F"),
    ("qwen3", True, ["lm_head"], (EMBED,), 1.7, 0, "F"),
    ("llama", False, ["model.layers.*.mlp.*"], MLP, 2.4, 1000, "1xN, 1xSAC.mm, 1xF"),
    ("llama", False, ["norm", "embed_tokens"], (NORM, EMBED), 2.0, 0, "F"),
]  # fmt: skip


@pytest.mark.parametrize(("arch", "tied", "patterns", "names", "clip", "chunk", "layers"), CASES)
def test_frozen_runs_match_a_requires_grad_false_reference(
    tmp_path: Path,
    arch: str,
    tied: bool,
    patterns: list[str],
    names: tuple[str, ...],
    clip: float,
    chunk: int,
    layers: str,
) -> None:
    model = make_model(tmp_path, arch, tied=tied, layers=3)
    assert frozen_names(HFAdapter.from_dir(model), patterns) == set(names)
    data = write_data(tmp_path / "data.jsonl", 30)
    train = {"max_steps": 8, "global_batch_size": 4, "learning_rate": 3e-3, "weight_decay": 0.1,
             "max_grad_norm": clip, "lr_scheduler": "cosine", "warmup_steps": 2,
             "freeze": patterns}  # fmt: skip
    out = tmp_path / "out"
    runtime = {"chunk_elems": chunk, "grad_slots": 2 if chunk else 4, "layers": layers}
    config = write_config(tmp_path / "c.yaml", model, data, out, train=train, runtime=runtime,
                          output={"tensorboard": False})  # fmt: skip
    assert main(["train", str(config)]) == 0

    ref = reference_train(model, data, train, frozen=names)
    metrics = read_metrics(out)
    torch.testing.assert_close(torch.tensor([m["loss"] for m in metrics], dtype=torch.float64),
                               torch.tensor(ref.losses, dtype=torch.float64),
                               rtol=LOSS_RTOL, atol=0)  # fmt: skip
    torch.testing.assert_close(torch.tensor([m["grad_norm"] for m in metrics]),
                               torch.tensor(ref.grad_norms), rtol=LOSS_RTOL, atol=0)  # fmt: skip
    if clip:
        norms = [round(m["grad_norm"], 2) for m in metrics]
        assert any(m["clip_coef"] < 1.0 for m in metrics), f"clipping binds sometimes: {norms}"
    final = load_file(out / "final" / "model.safetensors")
    start = load_file(model / "model.safetensors")
    for name in names:
        assert torch.equal(final[name], start[name]), f"{name} moved"
    trained = set(final) - set(names)
    worst = max((final[n] - ref.params[n]).abs().max().item() for n in trained)
    assert worst <= PARAM_ATOL
    moved = [n for n in trained if not torch.equal(final[n], start[n])]
    assert len(moved) == len(trained), "every trained parameter moves"
    moments = load_file(out / "checkpoint-8" / OPTIMIZER_DIR / "exp_avg.safetensors")
    assert set(moments) == trained, "a frozen parameter has no Adam moments"


def test_the_backward_stops_below_the_lowest_trained_layer(tmp_path: Path) -> None:
    adapter = HFAdapter.from_dir(make_model(tmp_path, "qwen3", tied=False, layers=4))
    adapter.frozen = frozen_names(adapter, ["embed_tokens", "layers.0-1", "*.mlp.*"])
    tr = Trained.of(adapter)
    assert (tr.embed, tr.norm, tr.head, tr.lowest) == (False, True, True, 2)
    assert tr.input_grad == (False, False, False, True)  # layer 2's input feeds nothing trained
    assert tr.layer_frozen[3] == {"mlp.gate_proj.weight", "mlp.up_proj.weight",
                                  "mlp.down_proj.weight"}  # fmt: skip
    adapter.frozen = frozen_names(adapter, ["layers.1-3", "norm", "lm_head"])
    tr = Trained.of(adapter)
    assert (tr.embed, tr.norm, tr.head, tr.lowest) == (True, False, False, 0)
    assert tr.input_grad == (True, True, True, True)


def test_frozen_resident_layers_train_bit_for_bit_like_the_frozen_all_host_run(
    tmp_path: Path,
) -> None:
    """GPU-resident groups (on CPU: the host AdamW kernel, bit for bit the streamed run) update
    their trained parameters only: a frozen layer, a half-frozen one, a head without its
    weight."""
    model = make_model(tmp_path, "llama", tied=False, layers=3)
    data = write_data(tmp_path / "data.jsonl", 30)
    train = {"max_steps": 4, "global_batch_size": 4, "learning_rate": 3e-3, "max_grad_norm": 1.0,
             "freeze": ["layers.0", "*.mlp.*", "lm_head"]}  # fmt: skip
    runs = {}
    on_device = ["runtime.resident_layers=2", "runtime.resident_embeddings=true"]
    for name, resident in (("host", []), ("resident", on_device)):
        out = tmp_path / name
        config = write_config(tmp_path / f"{name}.yaml", model, data, out, train=train,
                              output={"tensorboard": False})  # fmt: skip
        assert main(["train", str(config), *resident]) == 0
        runs[name] = out
    host, resident_run = (read_metrics(runs[n]) for n in ("host", "resident"))
    for key in ("loss", "grad_norm", "clip_coef"):
        assert [r[key] for r in resident_run] == [r[key] for r in host], key
    for part in ("final/model.safetensors", f"checkpoint-4/{OPTIMIZER_DIR}/exp_avg.safetensors"):
        a, b = (load_file(runs[n] / part) for n in ("host", "resident"))
        assert set(a) == set(b)
        assert all(torch.equal(a[n], b[n]) for n in a), part
    start = load_file(model / "model.safetensors")
    final = load_file(runs["resident"] / "final/model.safetensors")
    assert torch.equal(final["lm_head.weight"], start["lm_head.weight"])
    assert torch.equal(final["model.layers.1.mlp.up_proj.weight"],
                       start["model.layers.1.mlp.up_proj.weight"])  # fmt: skip
