"""Fill the host store's FP32 master weights: from safetensors files, or from a seeded init.

Weights stream tensor by tensor (``safe_open``) straight into ``store.param(name)``: at most one
tensor of the checkpoint is in memory besides the store. With no weight files, each module is
built on CPU one at a time and initialised by the model's own ``_init_weights`` (the scheme of
``from_config``: normal(std=initializer_range) for linears and embeddings, zero biases, unit
norms), then copied in; the full model never exists outside the store.
"""

from __future__ import annotations

import copy
import json
from pathlib import Path

import torch
from safetensors import SafetensorError, safe_open
from torch import nn

from slidedp.errors import ModelLoadError
from slidedp.models.hf import EMBED, LM_HEAD, NORM, HFAdapter
from slidedp.store import HostStore


def weight_files(path: Path) -> list[Path]:
    """The model's safetensors files (sharded through an index or single); [] if none."""
    index = path / "model.safetensors.index.json"
    if index.is_file():
        try:
            weight_map = json.loads(index.read_text())["weight_map"]
            files = [path / f for f in sorted(set(weight_map.values()))]
        except (ValueError, KeyError, TypeError, AttributeError) as e:
            raise ModelLoadError(
                f"{index} is not a safetensors index ({type(e).__name__}: {e}); "
                "re-download or re-export the model"
            ) from None
        missing = [f.name for f in files if not f.is_file()]
        if missing:
            raise ModelLoadError(
                f"{index} lists weight files that are not in {path}: {', '.join(missing[:3])}; "
                "re-download the model (all shards)"
            )
        return files
    return sorted(path.glob("*.safetensors"))


_FLOAT_DTYPES = ("F64", "F32", "F16", "BF16")  # safetensors' names


def _expected_shape(
    adapter: HFAdapter, shapes: dict[str, tuple[int, ...]], file: Path, name: str
) -> tuple[int, ...] | None:
    """The shape a checkpoint tensor must have, None for one to skip; else ModelLoadError."""
    if name in shapes:
        return shapes[name]
    if name == LM_HEAD and adapter.tied:
        return None  # the tied head is the embedding; one parameter
    if name.endswith("rotary_emb.inv_freq"):
        return None  # a buffer some old checkpoints carry
    raise ModelLoadError(
        f"{file.name}: tensor '{name}' is not a parameter of this {adapter.config.model_type} "
        "config; the weights belong to another model (check model.path)"
    )


def check_weight_files(adapter: HFAdapter, files: list[Path]) -> None:
    """Every tensor of ``files`` against the model (name, shape, float dtype, none missing), from
    the safetensors headers only: no tensor data is read. ``safe_open`` also checks the header's
    offsets against the file size, so a truncated or garbled file is a ``ModelLoadError``."""
    shapes = adapter.shapes()
    seen: set[str] = set()
    for file in files:
        try:
            with safe_open(str(file), framework="pt") as f:
                header = {n: f.get_slice(n) for n in f.keys()}  # noqa: SIM118 (not a mapping)
                tensors = {n: (tuple(s.get_shape()), s.get_dtype()) for n, s in header.items()}
        except (SafetensorError, OSError) as e:
            raise ModelLoadError(
                f"corrupt safetensors file {file} ({e}); re-download or re-export it"
            ) from None
        for name, (shape, dtype) in tensors.items():
            expected = _expected_shape(adapter, shapes, file, name)
            if expected is None:
                continue
            if shape != expected:
                raise ModelLoadError(
                    f"{file.name}: '{name}' has shape {shape}, the model's config.json expects "
                    f"{expected}; the weights and config.json do not match"
                )
            if dtype not in _FLOAT_DTYPES:
                raise ModelLoadError(
                    f"{file.name}: '{name}' is {dtype}; quantized checkpoints are not supported "
                    "(use the unquantized model)"
                )
            seen.add(name)
    missing = [n for n in shapes if n not in seen]
    if files and missing:
        raise ModelLoadError(
            f"weights missing from the checkpoint: {', '.join(missing[:5])}"
            f"{' ...' if len(missing) > 5 else ''} ({len(missing)} tensors); "
            "re-download the model or remove its safetensors files to start from a seeded init"
        )


def load_weights(adapter: HFAdapter, store: HostStore, files: list[Path]) -> None:
    """Copy every stored parameter from ``files`` into the master region (cast to f32), after
    ``check_weight_files`` accepted them (so a bad file fails before any copy)."""
    check_weight_files(adapter, files)
    shapes = adapter.shapes()
    for file in files:
        with safe_open(str(file), framework="pt") as f:
            for name in f.keys():  # noqa: SIM118 (safe_open is not a mapping)
                if _expected_shape(adapter, shapes, file, name) is not None:
                    store.param(name).copy_(f.get_tensor(name))


def _init_module(adapter: HFAdapter, module: nn.Module) -> None:
    for sub in module.modules():
        adapter.skeleton._init_weights(sub)  # type: ignore[no-untyped-call]


def init_weights(adapter: HFAdapter, store: HostStore, seed: int) -> None:
    """Seeded init from the config, one module at a time (embed, layers in order, norm, head)."""
    torch.manual_seed(seed)
    base = adapter.base
    with torch.device("cpu"):
        embed = nn.Embedding(adapter.vocab_size, adapter.hidden_size, adapter.padding_idx)
        _init_module(adapter, embed)
        store.param(EMBED).copy_(embed.weight.detach())
        del embed
        for i in range(adapter.num_layers):
            with torch.device("meta"):  # skip torch's default init: _init_weights sets it all
                layer = type(base.layers[i])(adapter.config, i)
            layer = layer.to_empty(device="cpu")
            for param in layer.parameters():
                param.detach().fill_(float("nan"))  # any tensor _init_weights missed shows
            _init_module(adapter, layer)
            missed = [n for n, p in layer.named_parameters() if not torch.isfinite(p).all()]
            if missed:
                raise ModelLoadError(
                    f"{adapter.config.model_type}'s _init_weights does not initialise {missed}; "
                    "start from a model directory with weights"
                )
            for full, local in adapter.groups[adapter.layer_group(i)].params:
                store.param(full).copy_(layer.get_parameter(local).detach())
            del layer
        norm = copy.deepcopy(base.norm).to_empty(device="cpu")  # Gemma's takes other args
        _init_module(adapter, norm)
        store.param(NORM).copy_(norm.weight.detach())
        if not adapter.tied:
            head = nn.Linear(adapter.hidden_size, adapter.vocab_size, bias=False)
            _init_module(adapter, head)
            store.param(LM_HEAD).copy_(head.weight.detach())


def fill_master(adapter: HFAdapter, store: HostStore, seed: int) -> str:
    """Load weights if the model directory has any, else init; returns which was done."""
    files = weight_files(adapter.path) if adapter.path is not None else []
    if files:
        load_weights(adapter, store, files)
        return f"loaded {len(files)} safetensors file(s)"
    init_weights(adapter, store, seed)
    return f"initialised from the config (seed {seed})"
