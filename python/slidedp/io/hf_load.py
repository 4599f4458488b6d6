"""Fill the host store's FP32 master weights: from safetensors files, or from a seeded init.

Weights stream tensor by tensor (``safe_open``) straight into ``store.param(name)``: at most one
tensor of the checkpoint is in memory besides the store. With no weight files, each module is
built on CPU one at a time and initialised by the model's own ``_init_weights`` (the scheme of
``from_config``: normal(std=initializer_range) for linears and embeddings, zero biases, unit
norms), then copied in; the full model never exists outside the store.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch
from safetensors import safe_open
from torch import nn

from slidedp.errors import ModelLoadError
from slidedp.models.hf import EMBED, LM_HEAD, NORM, HFAdapter
from slidedp.store import HostStore


def weight_files(path: Path) -> list[Path]:
    """The model's safetensors files (sharded through an index or single); [] if none."""
    index = path / "model.safetensors.index.json"
    if index.is_file():
        weight_map = json.loads(index.read_text())["weight_map"]
        return [path / f for f in sorted(set(weight_map.values()))]
    return sorted(path.glob("*.safetensors"))


def load_weights(adapter: HFAdapter, store: HostStore, files: list[Path]) -> None:
    """Copy every stored parameter from ``files`` into the master region (cast to f32)."""
    shapes = adapter.shapes()
    seen: set[str] = set()
    for file in files:
        with safe_open(str(file), framework="pt") as f:
            for name in f.keys():  # noqa: SIM118 (safe_open is not a mapping)
                if name not in shapes:
                    if name == LM_HEAD and adapter.tied:
                        continue  # the tied head is the embedding; one parameter
                    if name.endswith("rotary_emb.inv_freq"):
                        continue  # a buffer some old checkpoints carry
                    raise ModelLoadError(f"{file.name}: tensor '{name}' is not a model parameter")
                tensor = f.get_tensor(name)
                if tuple(tensor.shape) != shapes[name]:
                    raise ModelLoadError(
                        f"{file.name}: '{name}' has shape {tuple(tensor.shape)}, "
                        f"the config expects {shapes[name]}"
                    )
                store.param(name).copy_(tensor)
                seen.add(name)
    missing = [n for n in shapes if n not in seen]
    if missing:
        raise ModelLoadError(f"weights missing from the checkpoint: {', '.join(missing[:5])}")


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
            layer = type(base.layers[i])(adapter.config, i)
            _init_module(adapter, layer)
            for full, local in adapter.groups[adapter.layer_group(i)].params:
                store.param(full).copy_(layer.get_parameter(local).detach())
            del layer
        norm = type(base.norm)(adapter.hidden_size, eps=base.norm.variance_epsilon)
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
