"""Fast layer compute (``models.fast``): the kernel/compile choice, Liger's patching, and the
compiled decoder layer against the eager one, CPU float32.

The compiled layer runs the graph dynamo traced from transformers' own forward through
``aot_eager`` (the same aten operations, each run by its eager kernel: inductor would fuse
them, which needs a C++ toolchain and minutes per model, and changes the rounding), so its
losses and weights must equal the eager run's bit for bit; a guard or a graph that went wrong
shows as a different loss. Compilations are counted with a counting backend: a recompilation
per layer (a guard on the module or on the slot's views) or per step would add frames.
Liger's kernels are Triton (CUDA only): on CPU the tests check the choice and that every norm,
MLP and the rotary function were replaced; its numerics are checked on the GPU
(``tests/engine/test_gpu_parity.py``).
"""

from __future__ import annotations

import logging
import threading
from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors.torch import load_file
from torch import nn
from torch._dynamo.testing import CompileCounterWithBackend
from transformers.models.llama import modeling_llama
from transformers.models.qwen3 import modeling_qwen3

from engine.tiny import make_model, read_metrics, tiny_config, write_config, write_data
from slidedp.cli import main
from slidedp.config import load_config
from slidedp.errors import ConfigError
from slidedp.models import fast
from slidedp.models.bind import bind_params
from slidedp.models.hf import HFAdapter
from slidedp.plan.cost import layer_footprint
from slidedp.plan.layout import parse_entry
from slidedp.plan.policy import Policy, resolve_policy

COUNTER = CompileCounterWithBackend("aot_eager")
if "slidedp_count" not in torch._dynamo.list_backends(exclude_tags=()):
    torch._dynamo.register_backend(COUNTER, name="slidedp_count")
CPU, CUDA = torch.device("cpu"), torch.device("cuda")
# transformers' rotary functions, taken before any test patches a model (a patched model type's
# module name is fast's dispatcher from then on)
HF_ROPE = {m.__name__.rpartition("_")[2]: m.apply_rotary_pos_emb
           for m in (modeling_llama, modeling_qwen3)}  # fmt: skip


def _adapter(arch: str = "qwen3") -> HFAdapter:
    return HFAdapter(tiny_config(arch, tied=True, layers=2))


def test_auto_runs_eager_on_cpu_and_says_why_once() -> None:
    compute = fast.resolve_compute("auto", None, CPU, _adapter())
    assert (compute.kernels, compute.compile) == ("eager", "")
    assert compute.describe().count("CUDA/Triton only: eager on CPU") == 1


def test_auto_picks_liger_on_cuda_where_it_is_installed_and_compiles_the_eager_fallback(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    adapter = _adapter()
    assert fast.resolve_compute("auto", None, CUDA, adapter) == fast.Compute("liger", "")
    # compiling asked for: transformers' modules, since Liger's compiled kernels fail parity
    compiled = fast.resolve_compute("auto", True, CUDA, adapter)
    assert (compiled.kernels, compiled.compile) == ("eager", "inductor")
    assert "never compiled" in compiled.reason
    with pytest.raises(ConfigError, match=r"runtime\.kernels=liger with runtime\.compile=true"):
        fast.resolve_compute("liger", True, CUDA, adapter)
    assert fast.resolve_compute("eager", None, CUDA, adapter) == fast.Compute("eager", "inductor")
    gemma = fast.resolve_compute("auto", False, CUDA, _adapter("gemma3_text"))
    assert gemma.kernels == "eager"
    assert "qwen3 layers only" in gemma.reason
    moe = _adapter("qwen3_moe")  # router logits recorded by per-call hooks: not compiled
    assert fast.resolve_compute("auto", None, CUDA, moe).compile == ""
    with pytest.raises(ConfigError, match=r"set runtime\.compile=false"):
        fast.resolve_compute("auto", True, CUDA, moe)
    monkeypatch.setattr(fast, "liger_available", lambda: False)
    fallback = fast.resolve_compute("auto", None, CUDA, adapter)
    assert fallback == fast.Compute("eager", "inductor", fallback.reason)
    assert (
        "liger_kernel is not installed or does not import (pip install 'slidedp[fast]'): "
        "eager fallback" in fallback.describe()
    )
    with pytest.raises(ConfigError, match=r"runtime\.kernels=liger cannot run here: liger_kernel"):
        fast.resolve_compute("liger", None, CUDA, adapter)


def test_liger_on_cpu_and_a_bad_value_are_one_line_config_errors(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="CUDA/Triton only"):
        fast.resolve_compute("liger", None, CPU, _adapter())
    model = make_model(tmp_path, "qwen3", tied=True)
    data = write_data(tmp_path / "data.jsonl", 4)
    config = write_config(tmp_path / "c.yaml", model, data, tmp_path / "out")
    with pytest.raises(ConfigError, match=r"runtime.kernels must be one of .*got 'fused'"):
        load_config(config, ["runtime.kernels=fused"])
    with pytest.raises(ConfigError, match=r"runtime\.compile must be"):
        load_config(config, ["runtime.compile=sometimes"])


def test_a_policy_file_sets_the_layer_compute_and_it_is_saved_with_the_policy(
    tmp_path: Path,
) -> None:
    model = make_model(tmp_path, "qwen3", tied=True)
    data = write_data(tmp_path / "data.jsonl", 4)
    policy_file = tmp_path / "policy.yaml"
    policy_file.write_text("kernels: eager\ncompile: true\n")
    config = write_config(tmp_path / "c.yaml", model, data, tmp_path / "out",
                          runtime={"policy": str(policy_file)})  # fmt: skip
    policy = resolve_policy(load_config(config).runtime, HFAdapter.from_dir(model),
                            mirror=False, device=CPU)  # fmt: skip
    assert policy.compute == fast.Compute("eager", "inductor")
    assert Policy.from_dict(policy.to_dict()) == policy


def _liger_recorders(monkeypatch: pytest.MonkeyPatch) -> list[str]:
    """Liger's RMSNorm, SwiGLU and RoPE replaced by recorders (Triton does not run on CPU) that
    compute with transformers' math; the list names each call."""
    from liger_kernel.transformers import rope
    from liger_kernel.transformers.rms_norm import LigerRMSNorm
    from liger_kernel.transformers.swiglu import LigerSwiGLUMLP

    calls: list[str] = []

    def norm(self: Any, x: torch.Tensor) -> Any:
        calls.append("norm")
        out: torch.Tensor = type(self).forward(self, x)
        return out

    def mlp(self: Any, x: torch.Tensor) -> Any:
        calls.append("mlp")
        out: torch.Tensor = type(self).forward(self, x)
        return out

    def rotary(q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> Any:
        calls.append("rope")
        return HF_ROPE["qwen3"](q, k, cos, sin)

    monkeypatch.setattr(LigerRMSNorm, "forward", norm)
    monkeypatch.setattr(LigerSwiGLUMLP, "forward", mlp)
    monkeypatch.setattr(rope, "liger_rotary_pos_emb", rotary)
    return calls


def test_liger_replaces_every_norm_and_the_swiglu(monkeypatch: pytest.MonkeyPatch) -> None:
    calls = _liger_recorders(monkeypatch)
    adapter = _adapter()
    fast.apply_compute(adapter, fast.Compute("liger", ""))
    # Liger's warnings of its missing other backends would reach stderr once per rank
    assert logging.getLogger(fast.LIGER_REGISTRY_LOG).getEffectiveLevel() == logging.ERROR
    norms: list[Any] = [m for m in adapter.skeleton.modules() if type(m).__name__ == "Qwen3RMSNorm"]
    assert len(norms) == 2 * 4 + 1  # per layer: input, post-attention, q, k; the final norm
    assert all(m.casting_mode == "llama" and m.offset == 0.0 for m in norms)
    mlps: list[Any] = [adapter.layer_module(i).mlp for i in range(adapter.num_layers)]
    for module in norms:
        module.weight = nn.Parameter(torch.ones(module.weight.shape))
        module(torch.randn(2, module.weight.shape[0]))
    assert calls == ["norm"] * len(norms)
    for module in mlps:
        for proj in (module.gate_proj, module.up_proj, module.down_proj):
            proj.weight = nn.Parameter(torch.randn(proj.weight.shape) * 0.1)
        module(torch.randn(2, adapter.hidden_size))
    assert calls == ["norm"] * len(norms) + ["mlp"] * len(mlps)


def test_the_cost_model_runs_liger_layers_as_their_meta_twins(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The cost model's meta-device runs of a Liger-patched layer (a profile's candidate, a
    layout priced after the engine started) never reach a Triton kernel (on a GPU that was an
    illegal memory access): they run the twins of Liger's Functions (``models.liger_twins``),
    so they count what the estimate counts for a run that will patch Liger in."""
    calls = _liger_recorders(monkeypatch)
    layouts = ["F", "N-r0.5", "SAC.mm-r1", "S1010100-r0.6", "S0000100-r0.3"]
    unpatched = _adapter()
    planned = [layer_footprint(unpatched, parse_entry(e, 0.0)[1], 2, 16, torch.float32,
                               kernels="liger") for e in layouts]  # fmt: skip
    eager = [layer_footprint(_adapter(), parse_entry(e, 0.0)[1], 2, 16, torch.float32)
             for e in layouts]  # fmt: skip
    adapter = _adapter()
    fast.apply_compute(adapter, fast.Compute("liger", ""))
    patched = [layer_footprint(adapter, parse_entry(e, 0.0)[1], 2, 16, torch.float32)
               for e in layouts]  # fmt: skip
    assert calls == []
    assert [(f.saved, f.retained_bytes, f.replay_bytes) for f in patched] == [
        (f.saved, f.retained_bytes, f.replay_bytes) for f in planned
    ]
    assert planned[0].replay_bytes < eager[0].replay_bytes  # F: Liger keeps fewer copies
    for module in unpatched.layer_module(0).modules():
        assert "forward" not in module.__dict__, "the twins are taken out after the count"


def _bound_attention(adapter: HFAdapter) -> Any:
    """Layer 0's attention with random weights bound (``bind_params``)."""
    group = adapter.groups[adapter.layer_group(0)]
    shapes = adapter.shapes()
    gen = torch.Generator().manual_seed(0)
    params = {local: torch.randn(shapes[full], generator=gen) * 0.1 for full, local in group.params}
    bind_params(adapter.layer_module(0), params)
    return adapter.layer_module(0).self_attn


def _rope_recorder(monkeypatch: pytest.MonkeyPatch, calls: list[Any]) -> None:
    """Liger's rotary function replaced by one that appends the calling thread to ``calls`` and
    computes with transformers' (Triton does not run on CPU)."""
    from liger_kernel.transformers import rope

    def recorder(q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> Any:
        calls.append(threading.current_thread())
        return HF_ROPE["llama"](q, k, cos, sin)

    monkeypatch.setattr(rope, "liger_rotary_pos_emb", recorder)


def _attention_inputs(adapter: HFAdapter) -> tuple[torch.Tensor, Any]:
    x = torch.randn(2, 12, 64)
    positions = torch.arange(12).unsqueeze(0)
    return x, adapter.position_embeddings(adapter.make_rotary(CPU), x, positions)[0]


def test_liger_rope_runs_only_inside_the_patched_attention(monkeypatch: pytest.MonkeyPatch) -> None:
    """An eager model of the same type in the same process (the cost model's meta runs, a
    reference built after) keeps transformers' rotary function."""
    calls: list[Any] = []
    _rope_recorder(monkeypatch, calls)
    patched, plain = _adapter("llama"), _adapter("llama")
    fast.apply_compute(patched, fast.Compute("liger", ""))
    x, cos_sin = _attention_inputs(plain)
    outs = []
    for adapter in (plain, patched):
        attention = _bound_attention(adapter)
        outs.append(attention(x, position_embeddings=cos_sin, attention_mask=None)[0])
        assert len(calls) == (adapter is patched)
    assert torch.equal(outs[0], outs[1])  # the recorder computes with transformers' rope


def test_a_thread_outside_the_patched_attention_keeps_transformers_rope(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """While a thread is inside a patched attention (held in Liger's rotary function), the main
    thread's unpatched attention of the same model type runs transformers' rotary function: the
    patch is per thread (swapping the module's name for the call leaked into the other thread)."""
    from liger_kernel.transformers import rope

    inside, release = threading.Event(), threading.Event()
    calls: list[threading.Thread] = []

    def held(q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> Any:
        calls.append(threading.current_thread())
        if threading.current_thread() is not threading.main_thread():
            inside.set()
            assert release.wait(30)
        return HF_ROPE["llama"](q, k, cos, sin)

    monkeypatch.setattr(rope, "liger_rotary_pos_emb", held)  # Triton: not on CPU
    patched, plain = _adapter("llama"), _adapter("llama")
    fast.apply_compute(patched, fast.Compute("liger", ""))
    patched_attention, plain_attention = _bound_attention(patched), _bound_attention(plain)
    x, cos_sin = _attention_inputs(plain)
    outs: list[torch.Tensor] = []

    def run_patched() -> None:
        outs.append(patched_attention(x, position_embeddings=cos_sin, attention_mask=None)[0])

    worker = threading.Thread(target=run_patched)
    worker.start()
    try:
        assert inside.wait(30)
        alongside = plain_attention(x, position_embeddings=cos_sin, attention_mask=None)[0]
    finally:
        release.set()
        worker.join(30)
    assert calls == [worker]
    assert torch.equal(alongside, outs[0])


def test_apply_compute_twice_patches_once_and_another_compute_is_an_error(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    calls = _liger_recorders(monkeypatch)
    adapter = _adapter()
    liger = fast.Compute("liger", "")
    fast.apply_compute(adapter, liger)
    module: Any = adapter.layer_module(0)
    patched = (module.self_attn.forward, module.mlp.forward, module.input_layernorm.forward,
               adapter.norm_module().forward, adapter.layer_call)  # fmt: skip
    fast.apply_compute(adapter, fast.Compute("liger", "", reason="resolved again"))
    assert (module.self_attn.forward, module.mlp.forward, module.input_layernorm.forward,
            adapter.norm_module().forward, adapter.layer_call) == patched  # fmt: skip
    norm: Any = adapter.norm_module()
    norm.weight = nn.Parameter(torch.ones(norm.weight.shape))
    norm(torch.randn(2, norm.weight.shape[0]))
    assert calls == ["norm"]  # one Liger norm, not a Liger norm wrapping another
    with pytest.raises(RuntimeError, match=r"patched for liger .* not eager, compiled"):
        fast.apply_compute(adapter, fast.Compute("eager", "inductor"))
    compiled = _adapter()
    fast.apply_compute(compiled, fast.Compute("eager", "aot_eager"))
    layer_call = compiled.layer_call
    fast.apply_compute(compiled, fast.Compute("eager", "aot_eager"))
    assert compiled.layer_call is layer_call  # the compiled callable (and its graphs) kept


def test_a_layer_past_the_recompile_limit_is_one_slidedp_warning(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """Dynamo runs a frame eagerly once it recompiled it ``recompile_limit`` times; slidedp says
    so once. Limit 1: the layer's first call compiles, a call with grad (another graph) hits it."""
    monkeypatch.setattr(fast._RECOMPILE_LIMIT, "told", False)
    torch._dynamo.reset()
    adapter = _adapter()
    fast.apply_compute(adapter, fast.Compute("eager", "eager"))
    _bound_attention(adapter)  # binds layer 0's parameters
    layer = adapter.layer_module(0)
    x, cos_sin = _attention_inputs(adapter)  # x: [2, 12, hidden]
    kwargs = {"position_embeddings": cos_sin, "attention_mask": None}
    try:
        with torch._dynamo.config.patch(recompile_limit=1), torch.no_grad():
            adapter.layer_call(layer, x, kwargs)
        with torch._dynamo.config.patch(recompile_limit=1):
            adapter.layer_call(layer, x.requires_grad_(), kwargs)
    finally:
        torch._dynamo.reset()
    lines = [line for line in capsys.readouterr().err.splitlines() if line.startswith("slidedp")]
    assert lines == [
        "slidedp: warning: the compiled decoder layer (eager, compiled (eager), attention SDPA) "
        "hit torch._dynamo.config.recompile_limit=1 and now runs eagerly (slower); set "
        "runtime.compile=false, or run with TORCH_LOGS=recompiles to see what changes between "
        "calls"
    ]


STEPS = 4
TRAIN = {"max_steps": STEPS, "global_batch_size": 4, "learning_rate": 3e-3, "max_grad_norm": 2.4}


def _train(
    tmp_path: Path, model: Path, name: str, runtime: dict[str, object]
) -> tuple[list[tuple[float, float]], dict[str, torch.Tensor]]:
    data = write_data(tmp_path / "data.jsonl", 32, min_len=20, max_len=20)  # no padding
    out = tmp_path / name
    config = write_config(tmp_path / f"{name}.yaml", model, data, out, train=TRAIN,
                          runtime=runtime, output={"tensorboard": False})  # fmt: skip
    assert main(["train", str(config)]) == 0
    metrics = [(m["loss"], m["grad_norm"]) for m in read_metrics(out)]
    return metrics, load_file(out / "final" / "model.safetensors")


@pytest.mark.e2e
@pytest.mark.parametrize(
    ("arch", "tied", "layers", "graphs"),
    [
        ("qwen3", True, "F", 2),
        ("llama", False, "2xF-r1, 1xN-r0.5, 1xSAC.mm, S1010100", 2),
        # SAC's region runs eagerly: on the GPU an inductor kernel reusing a buffer mutates a
        # tensor the policy cached, and torch refuses the replay
        ("qwen3", True, "SAC.mm", 0),
    ],
)
def test_the_compiled_layer_trains_bit_identically_and_compiles_once_per_mode(
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
    arch: str,
    tied: bool,
    layers: str,
    graphs: int,
) -> None:
    """Batches of one shape, no padding. Two graphs: F's forward runs without grad,
    its replay and N's forward with grad (S and SAC run eagerly). With
    padded batches of varying lengths, dynamo adds one graph per mode with a symbolic length
    at the second length, and one for a batch without padding (no mask tensor)."""
    model = make_model(tmp_path, arch, tied=tied, layers=5)
    eager_metrics, eager_params = _train(tmp_path, model, "eager", {"layers": layers})
    assert "layer compute: eager, not compiled" in capsys.readouterr().out
    monkeypatch.setattr(fast, "COMPILE_BACKEND", "slidedp_count")
    torch._dynamo.reset()
    COUNTER.clear()
    metrics, params = _train(tmp_path, model, "compiled", {"layers": layers, "compile": True})
    assert "compiled (slidedp_count)" in capsys.readouterr().out
    # 5 layers x 4 steps: the graphs of the first step serve every layer and step
    assert COUNTER.frame_count == graphs
    assert len(metrics) == STEPS
    assert metrics == eager_metrics  # losses and gradient norms, every step
    assert all(torch.equal(eager_params[k], params[k]) for k in params)


def test_liger_is_not_patched_into_a_model_whose_mlp_is_not_silu(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(fast, "liger_available", lambda: True)
    config = tiny_config("llama", tied=True, layers=2)
    config.hidden_act = "gelu"
    compute = fast.resolve_compute("auto", None, CUDA, HFAdapter(config))
    assert compute.kernels == "eager"
    assert "the model's MLP is gelu" in compute.reason
