"""Fast decoder-layer compute: Liger Kernel's fused modules and a compiled decoder layer.

Two choices of the Policy, resolved once per run by ``resolve_compute`` for the device and the
model (``runtime.kernels``, ``runtime.compile``) and applied to the adapter by ``apply_compute``
(the engine, the compute-only reference and ``slidedp profile layer`` all call it):

- ``kernels``: ``liger`` patches Liger Kernel's Triton kernels (the ``slidedp[fast]`` extra,
  ``pip install 'slidedp[fast]'``) into the adapter's modules — RMSNorm (each layer's input
  and post-attention norms, Qwen3's q/k norms, the final norm), SwiGLU (``act(gate) * up`` in
  one kernel) and RoPE (the modeling module's ``apply_rotary_pos_emb``, a module-level name
  transformers looks up at call time: replaced only while a patched attention runs). Segment
  checkpointing (``S``) runs the MLP's pieces itself, so its SwiGLU stays eager. Llama, Mistral,
  Qwen2 and Qwen3 get all three; Gemma 3 and the mixtures of experts keep transformers'
  modules. ``eager``: transformers' modules. ``auto``: ``liger`` where it can run (CUDA, a
  Llama-family model, ``liger_kernel`` importable), else ``eager`` with the reason in the
  banner. Asking for ``liger`` where it cannot run is a config error.
- ``compile``: every decoder layer runs through ONE ``torch.compile``d call (regional
  compilation). The layer module is an argument of the compiled function, and dynamo reads a
  module's parameters as graph inputs, so the slot views that ``bind_params`` re-binds on every
  load, and every layer of the same class, reuse the graph: one compilation per grad mode
  (the checkpointed forward runs without grad, the replay and ``N`` with it), none per layer or
  step (``tests/engine/test_fast.py`` counts them). The default (null) compiles on CUDA where
  the kernels are eager. On the H100 one Qwen3-8B layer (B=16, S=1024, fwd+bwd, BENCHMARKS.md
  issue #22) ran 446 model TFLOP/s eager, 618 with Liger, 627 compiled and 665 with both; the
  combination is not the default until it has passed the GPU parity test. ``S`` and ``SAC``
  layers run eagerly (SAC's policy must see every operator). The CPU test compiles with
  ``aot_eager``, whose bit-identity says nothing of inductor's fusions. The mixtures of
  experts are not compiled by default (their routing is data-dependent); with router logits
  (recorded by hooks registered per call) ``compile: true`` is a config error.

The loss head stays ``models.loss.chunked_lm_loss`` (a GEMM per chunk of labelled rows, its
memory bounded by ``runtime.loss_chunk_tokens``); attention is transformers' SDPA path, whose
backend PyTorch picks per call (flash or cuDNN without a mask tensor, memory-efficient with a
padding or packing mask; ``slidedp profile layer --kernels`` names the kernel that ran).

Example::

    compute = resolve_compute("auto", None, torch.device("cuda"), adapter)
    apply_compute(adapter, compute)
    print(compute.describe())   # 'liger (RMSNorm, RoPE, SwiGLU), not compiled, attention SDPA'
"""

from __future__ import annotations

import importlib
import importlib.util
import warnings
from dataclasses import dataclass
from types import MethodType
from typing import TYPE_CHECKING, Any, Literal

import torch
from torch import nn

from slidedp.errors import ConfigError

if TYPE_CHECKING:
    from slidedp.models.hf import HFAdapter

# model types whose decoder layer Liger's RMSNorm/RoPE/SwiGLU replace exactly
LIGER_MODEL_TYPES = ("llama", "mistral", "qwen2", "qwen3")
LIGER_OPS = "RMSNorm, RoPE, SwiGLU"
COMPILE_BACKEND = "inductor"


@dataclass(frozen=True)
class Compute:
    """The resolved choice: ``kernels`` that run, ``compile`` backend ("" = not compiled),
    and why ``auto`` chose what it chose (for the banner)."""

    kernels: Literal["eager", "liger"]
    compile: str
    reason: str = ""

    def describe(self) -> str:
        kernels = f"liger ({LIGER_OPS})" if self.kernels == "liger" else "eager"
        compiled = f"compiled ({self.compile})" if self.compile else "not compiled"
        why = f" [{self.reason}]" if self.reason else ""
        return f"{kernels}, {compiled}, attention SDPA{why}"


def liger_available() -> bool:
    """Whether Liger's modules import (installed, and its Triton/torch requirements met)."""
    if importlib.util.find_spec("liger_kernel") is None:
        return False
    try:
        importlib.import_module("liger_kernel.transformers.rms_norm")
        importlib.import_module("liger_kernel.transformers.rope")
        importlib.import_module("liger_kernel.transformers.swiglu")
    except Exception:  # a broken install: the eager fallback, with the banner's reason
        return False
    return True


def resolve_compute(
    kernels: str, compile: bool | None, device: torch.device, adapter: HFAdapter
) -> Compute:
    """``runtime.kernels`` / ``runtime.compile`` for ``device`` and ``adapter``'s model."""
    model_type = adapter.config.model_type
    blocker = ""
    if device.type != "cuda":
        blocker = "Liger Kernel is CUDA/Triton only: eager on CPU"
    elif model_type not in LIGER_MODEL_TYPES:
        blocker = f"Liger kernels are patched into {'/'.join(LIGER_MODEL_TYPES)} layers only"
    elif getattr(adapter.config, "hidden_act", "silu") not in ("silu", "swish"):
        # Liger's SwiGLU module computes SiLU whatever the config says
        blocker = f"Liger's SwiGLU is SiLU, the model's MLP is {adapter.config.hidden_act}"
    elif not liger_available():
        blocker = (
            "liger_kernel is not installed or does not import (pip install 'slidedp[fast]'): "
            "eager fallback"
        )
    if kernels == "liger" and blocker:
        raise ConfigError(f"runtime.kernels=liger cannot run here: {blocker}; use auto or eager")
    chosen: Literal["eager", "liger"] = "liger" if kernels != "eager" and not blocker else "eager"
    reason = blocker if kernels == "auto" else ""
    if compile is None:  # the dense layers measured; an MoE routes by data (graph breaks)
        from slidedp.models.hf import MOE_MODEL_TYPES  # hf imports this module

        compile = device.type == "cuda" and chosen == "eager" and model_type not in MOE_MODEL_TYPES
    if compile and adapter.router_loss is not None:
        raise ConfigError(
            "runtime.compile=true: a mixture-of-experts layer with output_router_logits records "
            "its router logits through per-call hooks, which the compiled layer cannot take; "
            "set runtime.compile=false"
        )
    return Compute(chosen, COMPILE_BACKEND if compile else "", reason)


def _off_meta(fast: Any, eager: Any) -> Any:
    """``fast`` (a Liger function) for real tensors, ``eager`` (transformers') for meta ones:
    the cost model runs these same modules on the meta device, where a Triton kernel would
    dereference a null pointer (an illegal memory access that poisons the CUDA context)."""

    def dispatch(x: torch.Tensor, *args: Any, **kwargs: Any) -> Any:
        return (eager if x.is_meta else fast)(x, *args, **kwargs)

    return dispatch


def _patch_rms_norm(module: nn.Module, rms_forward: Any) -> None:
    """A transformers Llama-style RMSNorm runs Liger's kernel (its weight stays the bound one)."""
    attrs = {"offset": 0.0, "casting_mode": "llama", "in_place": True, "row_mode": None}
    for name, value in attrs.items():
        setattr(module, name, value)
    module.forward = _off_meta(MethodType(rms_forward, module), module.forward)


def _scoped_rope(attention: nn.Module, modeling: Any, rope: Any) -> None:
    """``attention`` runs with ``rope`` as its modeling module's ``apply_rotary_pos_emb`` (the
    name transformers' attention forward looks up at call time), and every other caller —
    an eager model of the same type in this process, the cost model's meta-device runs —
    with transformers' own."""
    forward = attention.forward
    rope = _off_meta(rope, modeling.apply_rotary_pos_emb)

    def with_rope(*args: Any, **kwargs: Any) -> Any:
        original = modeling.apply_rotary_pos_emb
        modeling.apply_rotary_pos_emb = rope
        try:
            return forward(*args, **kwargs)
        finally:
            modeling.apply_rotary_pos_emb = original

    attention.forward = with_rope


def _apply_liger(adapter: HFAdapter) -> None:
    """Liger's RMSNorm, SwiGLU and RoPE in ``adapter``'s modules (instances: another adapter of
    the same model type keeps transformers' modules)."""
    from liger_kernel.transformers.rms_norm import LigerRMSNorm
    from liger_kernel.transformers.rope import liger_rotary_pos_emb
    from liger_kernel.transformers.swiglu import LigerSwiGLUMLP

    modeling: Any = importlib.import_module(type(adapter.base).__module__)
    _patch_rms_norm(adapter.norm_module(), LigerRMSNorm.forward)
    for layer in range(adapter.num_layers):
        module: Any = adapter.layer_module(layer)
        norms = [module.input_layernorm, module.post_attention_layernorm]
        norms += [getattr(module.self_attn, n) for n in ("q_norm", "k_norm")
                  if hasattr(module.self_attn, n)]  # fmt: skip
        for norm in norms:
            _patch_rms_norm(norm, LigerRMSNorm.forward)
        module.mlp.forward = _off_meta(MethodType(LigerSwiGLUMLP.forward, module.mlp),
                                       module.mlp.forward)  # fmt: skip
        _scoped_rope(module.self_attn, modeling, liger_rotary_pos_emb)


def call_layer(module: nn.Module, x: torch.Tensor, kwargs: dict[str, Any]) -> Any:
    return module(x, **kwargs)


def apply_compute(adapter: HFAdapter, compute: Compute) -> None:
    """Patch ``adapter`` (once: its modules are the run's) for ``compute``."""
    if compute.kernels == "liger":
        _apply_liger(adapter)
    if compute.compile:
        # dynamo reads .grad of every tensor input while tracing; the input of a layer whose
        # graph is kept (N, SAC) is a non-leaf (runtime.activations.base.InputGrad), which
        # makes torch warn about a read nobody makes
        warnings.filterwarnings("ignore", message=r"The \.grad attribute of a Tensor that is not")
    adapter.layer_call = (
        torch.compile(call_layer, backend=compute.compile) if compute.compile else call_layer
    )
