"""Fast decoder-layer compute: Liger Kernel's fused modules and a compiled decoder layer.

``resolve_compute`` picks, once per run, ``runtime.kernels`` (``liger``: Liger's RMSNorm, SwiGLU
and RoPE for the Llama family, the ``slidedp[fast]`` extra; ``eager``; ``auto``: liger where it
can run) and ``runtime.compile`` (every decoder layer through ONE ``torch.compile``d call, one
compilation per grad mode, none per layer or step); ``apply_compute`` patches the adapter.
Invariants: a second ``apply_compute`` with the same choice changes nothing, another choice is a
programming error; liger where it cannot run, liger with compile, and compile with router logits
are config errors; ``S`` and ``SAC`` layers run eagerly (docs/layer-compute.md).

Example::

    compute = resolve_compute("auto", None, torch.device("cuda"), adapter)
    apply_compute(adapter, compute)
"""

from __future__ import annotations

import importlib
import importlib.util
import logging
import sys
import threading
import warnings
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from types import MethodType
from typing import TYPE_CHECKING, Any, Literal

import torch
from torch import nn

from slidedp.errors import ConfigError
from slidedp.models.liger_twins import rms_norm_twin, rope_twin, swiglu_mlp_twin
from slidedp.models.tiled_mlp import check_tiling, use_tiled_mlps

if TYPE_CHECKING:
    from slidedp.models.hf import HFAdapter

# model types whose decoder layer Liger's RMSNorm/RoPE/SwiGLU replace exactly
LIGER_MODEL_TYPES = ("llama", "mistral", "qwen2", "qwen3")
LIGER_OPS = "RMSNorm, RoPE, SwiGLU"
COMPILE_BACKEND = "inductor"
LIGER_REGISTRY_LOG = "liger_kernel.backends.registry"


@dataclass(frozen=True)
class Compute:
    """The resolved choice: ``kernels`` that run, ``compile`` backend ("" = not compiled),
    and why ``auto`` chose what it chose (for the banner); the dense MLPs tiled by
    ``mlp_tile_tokens`` (0: untiled; ``models.tiled_mlp``)."""

    kernels: Literal["eager", "liger"]
    compile: str
    reason: str = ""
    mlp_tile_tokens: int = 0

    def describe(self) -> str:
        kernels = f"liger ({LIGER_OPS})" if self.kernels == "liger" else "eager"
        compiled = f"compiled ({self.compile})" if self.compile else "not compiled"
        why = f" [{self.reason}]" if self.reason else ""
        tiled = f", MLP by {self.mlp_tile_tokens}-token tiles" if self.mlp_tile_tokens else ""
        return f"{kernels}, {compiled}, attention SDPA{tiled}{why}"


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
    kernels: str,
    compile: bool | None,
    device: torch.device,
    adapter: HFAdapter,
    mlp_tile_tokens: int = 0,
) -> Compute:
    """``runtime.kernels`` / ``runtime.compile`` / ``runtime.mlp_tile_tokens`` for ``device``
    and ``adapter``'s model."""
    check_tiling(adapter, mlp_tile_tokens)
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
    if compile is None:  # the dense layers measured; an MoE routes by data (graph breaks);
        # layers of several kinds would each compile a graph of their own (not measured)
        one_kind = len(set(adapter.layer_kinds)) == 1
        compile = device.type == "cuda" and chosen == "eager" and one_kind and not adapter.moe
    if compile and chosen == "liger" and device.type == "cuda":
        # inductor takes Liger's Triton RMSNorm for a kernel that mutates every input: 200 bf16
        # steps drift 1.7e-2 from FSDP2 (benchmarks/2026-11-24-autopolicy-h100.md,
        # "Fast layer compute: the compiled layers' parity on the GPU")
        if kernels == "liger":
            raise ConfigError(
                "runtime.kernels=liger with runtime.compile=true fails the GPU parity test "
                "(Liger's Triton kernels under torch.compile); set runtime.compile=false, or "
                "runtime.kernels=eager to compile transformers' modules"
            )
        chosen, reason = "eager", "Liger's kernels are never compiled (wrong under torch.compile)"
    if compile and adapter.router_loss is not None:
        raise ConfigError(
            "runtime.compile=true: a mixture-of-experts layer with output_router_logits records "
            "its router logits through per-call hooks, which the compiled layer cannot take; "
            "set runtime.compile=false"
        )
    return Compute(chosen, COMPILE_BACKEND if compile else "", reason, mlp_tile_tokens)


def _off_meta(fast: Any, twin: Any) -> Any:
    """``fast`` (a Liger function) for real tensors, its ``twin`` for meta ones: the cost model
    runs these same modules on the meta device, where a Triton kernel would dereference a null
    pointer (an illegal memory access that poisons the CUDA context); the twin saves what the
    kernel saves (``models.liger_twins``)."""

    def dispatch(x: torch.Tensor, *args: Any, **kwargs: Any) -> Any:
        return (twin if x.is_meta else fast)(x, *args, **kwargs)

    return dispatch


def _patch_rms_norm(module: nn.Module, rms_forward: Any) -> None:
    """A transformers Llama-style RMSNorm runs Liger's kernel (its weight stays the bound one)."""
    attrs = {"offset": 0.0, "casting_mode": "llama", "in_place": True, "row_mode": None}
    for name, value in attrs.items():
        setattr(module, name, value)
    module.forward = _off_meta(MethodType(rms_forward, module), rms_norm_twin(module))


class _ActiveRope(threading.local):
    """The rotary function of the patched attention that this thread runs (None: transformers').
    Set in each thread's first use (``threading.local`` runs ``__init__`` per thread), not on the
    first patched call: a compiled layer would guard on its absence and recompile once."""

    def __init__(self) -> None:
        self.fn: Any = None


_active_rope = _ActiveRope()


def _rope_dispatcher(modeling: Any) -> Any:
    """transformers' ``apply_rotary_pos_emb`` of ``modeling``; the module's name now routes each
    call to the function of the patched attention running in the calling thread, else to
    transformers'. Installed once per module and never swapped afterwards, so threads that run
    attention concurrently (patched or not) each get their own (swapping the module global for
    the duration of a call would leak into the other thread's attention)."""
    current = modeling.apply_rotary_pos_emb
    eager = getattr(current, "slidedp_eager", None)
    if eager is not None:  # installed by an earlier adapter of this model type
        return eager

    def apply_rotary_pos_emb(*args: Any, **kwargs: Any) -> Any:
        rope = _active_rope.fn
        return (rope or current)(*args, **kwargs)

    apply_rotary_pos_emb.slidedp_eager = current  # type: ignore[attr-defined]
    modeling.apply_rotary_pos_emb = apply_rotary_pos_emb
    return current


def _scoped_rope(attention: nn.Module, modeling: Any, rope: Any) -> None:
    """``attention`` runs with ``rope`` as its modeling module's ``apply_rotary_pos_emb`` (the
    name transformers' attention forward looks up at call time; on meta tensors its twin, for
    the cost model), and every other caller — an eager model of the same type in this
    process, another thread — with transformers' own."""
    forward = attention.forward
    _rope_dispatcher(modeling)
    rope = _off_meta(rope, rope_twin)

    def with_rope(*args: Any, **kwargs: Any) -> Any:
        outer = _active_rope.fn
        _active_rope.fn = rope
        try:
            return forward(*args, **kwargs)
        finally:
            _active_rope.fn = outer

    attention.forward = with_rope


def _apply_liger(adapter: HFAdapter) -> None:
    """Liger's RMSNorm, SwiGLU and RoPE in ``adapter``'s modules (instances: another adapter of
    the same model type keeps transformers' modules)."""
    from liger_kernel.transformers.rms_norm import LigerRMSNorm  # noqa: PLC0415  optional: the fast extra
    from liger_kernel.transformers.rope import liger_rotary_pos_emb  # noqa: PLC0415  optional: the fast extra
    from liger_kernel.transformers.swiglu import LigerSwiGLUMLP  # noqa: PLC0415  optional: the fast extra

    # at an op's first call Liger imports its other backends (CuTe DSL, Ascend) and warns, in
    # every rank, of each one missing: the Triton kernels patched in here need none of them
    logging.getLogger(LIGER_REGISTRY_LOG).setLevel(logging.ERROR)
    modeling: Any = importlib.import_module(type(adapter.base).__module__)
    _patch_rms_norm(adapter.norm_module(), LigerRMSNorm.forward)
    for layer in range(adapter.num_layers):
        module: Any = adapter.layer_module(layer)
        for norm in _layer_norms(module):
            _patch_rms_norm(norm, LigerRMSNorm.forward)
        module.mlp.forward = _off_meta(MethodType(LigerSwiGLUMLP.forward, module.mlp),
                                       swiglu_mlp_twin(module.mlp))  # fmt: skip
        _scoped_rope(module.self_attn, modeling, liger_rotary_pos_emb)


def _layer_norms(module: Any) -> list[nn.Module]:
    """The RMSNorms of a Llama-family decoder layer that Liger replaces."""
    norms = [module.input_layernorm, module.post_attention_layernorm]
    return norms + [getattr(module.self_attn, n) for n in ("q_norm", "k_norm")
                    if hasattr(module.self_attn, n)]  # fmt: skip


@contextmanager
def liger_saved_tensors(adapter: HFAdapter, layer: int) -> Iterator[None]:
    """While this lasts, decoder layer ``layer`` of ``adapter`` saves on the meta device what
    it saves with Liger's kernels (``models.liger_twins``), whether or not the adapter is
    patched: the cost model's footprint of a run that will patch it (``plan.cost``)."""
    module: Any = adapter.layer_module(layer)
    modeling: Any = importlib.import_module(type(adapter.base).__module__)
    _rope_dispatcher(modeling)  # so that the thread's rotary function is looked up
    twins = [(n, rms_norm_twin(n)) for n in _layer_norms(module)]
    twins.append((module.mlp, swiglu_mlp_twin(module.mlp)))
    before = [(m, m.__dict__.get("forward")) for m, _ in twins]
    outer, _active_rope.fn = _active_rope.fn, rope_twin
    try:
        for m, twin in twins:
            m.forward = twin
        yield
    finally:
        _active_rope.fn = outer
        for m, forward in before:
            if forward is None:
                del m.forward  # the class's forward again
            else:
                m.forward = forward


def call_layer(module: nn.Module, x: torch.Tensor, kwargs: dict[str, Any]) -> Any:
    return module(x, **kwargs)


class _RecompileLimit(logging.Filter):
    """Watches dynamo's frame-conversion log for its one warning that a frame hit the recompile
    limit (from then on dynamo runs that frame eagerly), and says once, in one slidedp line,
    what that means for the compiled decoder layer. torch has no callback for it; the log
    record is the only signal short of ``fail_on_recompile_limit_hit`` (a process-wide switch
    that turns the fallback into an exception for every compiled function)."""

    def __init__(self) -> None:
        super().__init__()
        self.compute: Compute | None = None  # the compiled layer compute of this process
        self.told = False

    def filter(self, record: logging.LogRecord) -> bool:
        message = str(record.msg)
        if self.compute is not None and not self.told and message.startswith("torch._dynamo hit"):
            self.told = True
            args = record.args if isinstance(record.args, tuple) else ()
            limit = f"{args[0]}={args[1]}" if len(args) >= 2 else "recompile_limit"
            print(
                f"slidedp: warning: the compiled decoder layer ({self.compute.describe()}) hit "
                f"torch._dynamo.config.{limit} and now runs eagerly (slower); set "
                "runtime.compile=false, or run with TORCH_LOGS=recompiles to see what changes "
                "between calls",
                file=sys.stderr,
                flush=True,
            )
        return True  # torch's own warning is kept


_RECOMPILE_LIMIT = _RecompileLimit()
DYNAMO_LOG = "torch._dynamo.convert_frame"  # the logger of dynamo's recompile-limit warning


def apply_compute(adapter: HFAdapter, compute: Compute) -> None:
    """Patch ``adapter`` for ``compute`` (once: its modules are the run's). Again with the same
    kernels and compilation: nothing happens (the patches and the compiled call are kept);
    with another: ``RuntimeError``, a programming error."""
    if adapter.compute is not None:
        ran, wanted = adapter.compute, compute
        if (ran.kernels, ran.compile, ran.mlp_tile_tokens) != (
            wanted.kernels,
            wanted.compile,
            wanted.mlp_tile_tokens,
        ):
            raise RuntimeError(
                f"apply_compute: the adapter is patched for {adapter.compute.describe()}, "
                f"not {compute.describe()}; build another adapter"
            )
        return
    if compute.kernels == "liger":
        _apply_liger(adapter)
    if compute.mlp_tile_tokens:  # over Liger's SwiGLU where it runs
        use_tiled_mlps(adapter, compute.mlp_tile_tokens)
    if compute.compile:
        # dynamo reads .grad of every tensor input while tracing; the input of a layer whose
        # graph is kept (N, SAC) is a non-leaf (runtime.activations.base.InputGrad), which
        # makes torch warn about a read nobody makes
        warnings.filterwarnings("ignore", message=r"The \.grad attribute of a Tensor that is not")
        _RECOMPILE_LIMIT.compute = compute
        dynamo_log = logging.getLogger(DYNAMO_LOG)
        if _RECOMPILE_LIMIT not in dynamo_log.filters:
            dynamo_log.addFilter(_RECOMPILE_LIMIT)
    adapter.layer_call = (
        torch.compile(call_layer, backend=compute.compile) if compute.compile else call_layer
    )
    adapter.compute = compute
