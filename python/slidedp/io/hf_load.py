"""Fill the host store's FP32 master weights: from safetensors files, or from a seeded init.

Weights stream tensor by tensor (``safe_open``) straight into ``store.param(name)``: at most one
tensor of the checkpoint is in memory besides the store. A mixture of experts may come in its
model's fused expert layout or in the hub's, one tensor per expert (``io.hub_experts``); each
expert's tensor is copied into its slice of the fused parameter. Every header is checked
(``check_weight_files``) before the first tensor is read. With no weight files, each module is
built one at a time with the store's views as its parameters and initialised there by the
model's own ``_init_weights`` (the scheme of ``from_config``: normal(std=initializer_range) for
linears and embeddings, zero biases, unit norms); the model never exists outside the store.
"""

from __future__ import annotations

import copy
import json
from dataclasses import dataclass
from pathlib import Path, PurePosixPath
from typing import Any

import torch
from safetensors import SafetensorError, safe_open
from torch import nn

from slidedp.errors import ModelLoadError
from slidedp.io.hub_experts import HubLayout, Slot
from slidedp.io.parallel_init import ParallelNormal
from slidedp.kernels import default_threads
from slidedp.models.bind import bind_params
from slidedp.models.hf import EMBED, LM_HEAD, NORM, HFAdapter
from slidedp.store import HostStore

_OTHER_WEIGHTS = (".bin", ".pt", ".pth")  # PyTorch's pickled weights


def weight_files(path: Path) -> list[Path]:
    """The model's safetensors files (sharded through an index or single); [] for a config
    alone. Weights in another format, an index naming none, or a directory or index that cannot
    be read: ModelLoadError, never a silent seeded init."""
    index = path / "model.safetensors.index.json"
    if index.is_file():
        return _indexed(path, index)
    try:
        entries = sorted(path.iterdir())
    except OSError as e:
        raise _unreadable(path, e, "list the model directory") from None
    files = [p for p in entries if p.suffix == ".safetensors"]
    others = [p.name for p in entries if p.suffix in _OTHER_WEIGHTS]
    if not files and others:
        raise ModelLoadError(
            f"{path} holds {', '.join(others[:3])}{' ...' if len(others) > 3 else ''} but no "
            "*.safetensors: slidedp reads safetensors only; convert them (transformers' "
            "save_pretrained(..., safe_serialization=True)) or remove them to start from a "
            "seeded init"
        )
    return files


def _indexed(path: Path, index: Path) -> list[Path]:
    """The shards that ``index`` names, each checked to be there."""
    try:
        weight_map = json.loads(index.read_text())["weight_map"]
        names = sorted(set(weight_map.values()))
        files = [path / name for name in names]
    except OSError as e:
        raise _unreadable(index, e, "read") from None
    except (ValueError, KeyError, TypeError, AttributeError) as e:
        raise ModelLoadError(
            f"{index} is not a safetensors index ({type(e).__name__}: {e}); "
            "re-download or re-export the model"
        ) from None
    if not files:
        raise ModelLoadError(
            f"{index} names no weights (its weight_map is empty); fix it, or delete it to read "
            f"the *.safetensors files in {path}"
        )
    # by the names alone: the hub cache's shards are symlinks to files elsewhere
    outside = [n for n in names if PurePosixPath(n).is_absolute() or ".." in PurePosixPath(n).parts]
    if outside:  # another model's files, or none
        raise ModelLoadError(
            f"{index} names a weight file outside {path}: {outside[0]}; fix the index (shard "
            "names are relative to the model directory) or re-download the model"
        )
    missing = [f.name for f in files if not f.is_file()]
    if missing:
        raise ModelLoadError(
            f"{index} lists weight files that are not in {path}: {', '.join(missing[:3])}; "
            "re-download the model (all shards)"
        )
    return files


def _unreadable(path: Path, e: OSError, what: str) -> ModelLoadError:
    """The error of a ``what`` (read, list ...) of ``path`` that failed with ``e``."""
    if isinstance(e, PermissionError):
        return ModelLoadError(f"cannot {what} {path}: permission denied; fix its permissions")
    return ModelLoadError(f"cannot {what} {path} ({e.strerror or e}); check the path and disk")


_FLOAT_DTYPES = ("F64", "F32", "F16", "BF16")  # safetensors' names


@dataclass(frozen=True)
class Copy:
    """One checkpoint tensor, ``name`` (the model's name of it) stored as ``stored`` in
    ``file``, and the part of the store it fills."""

    file: Path
    name: str
    slot: Slot
    stored: str


@dataclass(frozen=True)
class WeightPlan:
    """What ``load_weights`` copies, in file order; ``per_expert``: the experts are stored one
    tensor each (the hub's layout, ``io.hub_experts``) and fused on the way into the store."""

    copies: tuple[Copy, ...]
    per_expert: bool

    def describe(self) -> str:
        return ", experts one tensor each (fused on load)" if self.per_expert else ""


def _slot(
    adapter: HFAdapter,
    shapes: dict[str, tuple[int, ...]],
    hub: HubLayout | None,
    file: Path,
    name: str,
) -> Slot | None:
    """Where a checkpoint tensor goes, None for one to skip; else ModelLoadError."""
    if name in shapes:
        return Slot(name, shapes[name])
    slot = hub.slot(name) if hub is not None else None
    if slot is not None:
        return slot
    if name == LM_HEAD and adapter.tied:
        return None  # the tied head is the embedding; one parameter
    if name.endswith("rotary_emb.inv_freq"):
        return None  # a buffer some old checkpoints carry
    if name in adapter.buffers.persistent:
        return None  # a layer's buffer: read by ``read_buffers``
    raise ModelLoadError(
        f"{file.name}: tensor '{name}' is not a parameter of this {adapter.config.model_type} "
        "config; the weights belong to another model (check model.path)"
    )


def _headers(file: Path) -> dict[str, tuple[tuple[int, ...], str]]:
    """Each tensor's (shape, dtype) from the file's header, no data read; ``safe_open`` checks
    the offsets against the file size, so a truncated or garbled file is a ModelLoadError."""
    try:
        file.open("rb").close()  # safe_open reports any failure to open as "No such file"
    except OSError as e:
        raise _unreadable(file, e, "read") from None
    try:
        with safe_open(str(file), framework="pt") as f:
            header = {n: f.get_slice(n) for n in f.keys()}  # noqa: SIM118 (not a mapping)
            return {n: (tuple(s.get_shape()), s.get_dtype()) for n, s in header.items()}
    except (SafetensorError, OSError) as e:
        raise ModelLoadError(
            f"corrupt safetensors file {file} ({e}); re-download or re-export it"
        ) from None


def _check_layouts(copies: list[Copy], hub: HubLayout | None) -> None:
    """One expert layout per checkpoint, each part of the store filled by one tensor."""
    if hub is not None:
        fused = next((c for c in copies if c.name in hub.fused), None)
        split = next((c for c in copies if hub.is_expert(c.name)), None)
        if fused is not None and split is not None:
            raise ModelLoadError(
                f"the checkpoint mixes two expert layouts: '{fused.name}' ({fused.file.name}) "
                f"holds all experts fused, '{split.name}' ({split.file.name}) one expert; "
                "keep one layout (re-download or re-export the model)"
            )
    filled: dict[Slot, Copy] = {}
    for c in copies:
        first = filled.setdefault(c.slot, c)
        if first is not c:
            raise ModelLoadError(
                f"'{first.name}' ({first.file.name}) and '{c.name}' ({c.file.name}) are both "
                f"'{c.slot.target}'{'' if c.slot.expert is None else f' of expert {c.slot.expert}'}"
                "; the checkpoint holds it twice: remove one (re-download or re-export the model)"
            )


def _missing(
    shapes: dict[str, tuple[int, ...]], copies: list[Copy], hub: HubLayout | None, per_expert: bool
) -> list[str]:
    """The tensors the checkpoint lacks, named in its own layout (a fused expert parameter of a
    per-expert checkpoint by the expert tensors that are not there)."""
    filled = {c.slot for c in copies}
    missing: list[str] = []
    for target, shape in shapes.items():
        if Slot(target, shape) in filled:
            continue
        parts = hub.parts(target) if hub is not None and per_expert else {}
        if parts:
            missing += [name for name, slot in parts.items() if slot not in filled]
        else:
            missing.append(target)
    return missing


def check_weight_files(adapter: HFAdapter, files: list[Path]) -> WeightPlan:
    """Every tensor of ``files`` against the model (name, shape, float dtype, none missing, none
    twice, one expert layout), from the safetensors headers only: no tensor data is read.
    Returns what ``load_weights`` copies where."""
    shapes = adapter.shapes()
    hub = HubLayout.of(adapter.config.model_type, shapes)
    copies: list[Copy] = []
    for file in files:
        for stored, (shape, dtype) in _headers(file).items():
            name = adapter.stored_name(stored)
            slot = None if name is None else _slot(adapter, shapes, hub, file, name)
            if name is None or slot is None:
                continue
            if shape != slot.shape:
                raise ModelLoadError(
                    f"{file.name}: '{stored}' has shape {shape}, the model's config.json expects "
                    f"{slot.shape}; the weights and config.json do not match"
                )
            if dtype not in _FLOAT_DTYPES:
                raise ModelLoadError(
                    f"{file.name}: '{stored}' is {dtype}; quantized checkpoints are not supported "
                    "(use the unquantized model)"
                )
            copies.append(Copy(file, name, slot, stored))
    _check_layouts(copies, hub)
    per_expert = hub is not None and any(hub.is_expert(c.name) for c in copies)
    missing = _missing(shapes, copies, hub, per_expert)
    if files and missing:
        raise ModelLoadError(
            f"weights missing from the model's safetensors files: {', '.join(missing[:5])}"
            f"{' ...' if len(missing) > 5 else ''} ({len(missing)} of them); "
            "re-download the model or remove its safetensors files to start from a seeded init"
        )
    return WeightPlan(tuple(copies), per_expert)


def load_weights(adapter: HFAdapter, store: HostStore, files: list[Path]) -> WeightPlan:
    """Copy every stored parameter from ``files`` into the master region (cast to f32), after
    ``check_weight_files`` accepted them (so a bad file fails before any copy): one tensor in
    memory at a time, an expert's straight into its slice of the fused parameter."""
    plan = check_weight_files(adapter, files)
    by_file: dict[Path, list[Copy]] = {file: [] for file in files}
    for c in plan.copies:
        by_file[c.file].append(c)
    for file, copies in by_file.items():
        with safe_open(str(file), framework="pt") as f:
            for c in copies:
                c.slot.view(store.param(c.slot.target)).copy_(f.get_tensor(c.stored))
    return plan


def read_buffers(adapter: HFAdapter, files: list[Path]) -> None:
    """The decoder layers' persistent buffers that ``files`` (a model's or a checkpoint's
    weights) carry into ``adapter.buffers`` (``models.buffers``); the others keep their
    ``_init_weights`` value. Every rank reads them: they are not in the shared store."""
    wanted = adapter.buffers.persistent
    for file in files:
        with safe_open(str(file), framework="pt") as f:
            for stored in f.keys():  # noqa: SIM118 (not a mapping)
                name = adapter.stored_name(stored)
                if name not in wanted:
                    continue
                value = f.get_tensor(stored)
                if tuple(value.shape) != wanted[name]:
                    raise ModelLoadError(
                        f"{file.name}: '{stored}' has shape {tuple(value.shape)}, the model's "
                        f"config.json expects {wanted[name]}; the weights and config.json do "
                        "not match"
                    )
                adapter.buffers.set(name, value)


def _init_module(adapter: HFAdapter, module: nn.Module) -> None:
    for sub in module.modules():
        adapter.skeleton._init_weights(sub)  # type: ignore[no-untyped-call]


def _initialised(
    adapter: HFAdapter, module: nn.Module, name: str, targets: dict[str, torch.Tensor]
) -> nn.Module:
    """``module`` (its storage on CPU, any contents) as the model's ``_init_weights`` sets it,
    in ``targets`` (its parameters, bound); a tensor it leaves unset, or one it replaces
    instead of setting (the store would keep the NaN), is one clear error, never
    uninitialised memory trained on."""
    bound = {local: t.data_ptr() for local, t in targets.items()}
    for param in module.parameters():
        param.detach().fill_(float("nan"))  # any tensor _init_weights missed shows
    _init_module(adapter, module)
    # a NaN left anywhere makes the sum NaN: one reduction, no tensor-sized mask allocated
    params = dict(module.named_parameters())
    missed = [f"{name}.{n}" for n, p in params.items() if torch.isnan(p.sum())]
    missed += [f"{name}.{n} (replaced)" for n, ptr in bound.items()
               if n not in params or params[n].data_ptr() != ptr]  # fmt: skip
    if missed:
        raise ModelLoadError(
            f"{adapter.config.model_type}'s _init_weights does not initialise {missed}; "
            "start from a model directory with weights"
        )
    return module


def _module(param: str) -> str:
    """The module's name of a parameter's full name (``lm_head.weight``: ``lm_head``)."""
    return param.rsplit(".", 1)[0]


def _fresh(
    adapter: HFAdapter,
    name: str,
    targets: dict[str, torch.Tensor],
    cls: type[nn.Module],
    *args: Any,
    **kwargs: Any,
) -> nn.Module:
    """``cls(*args, **kwargs)`` initialised by the model's ``_init_weights`` alone, straight
    into ``targets`` (its parameters' store views, by local name): built on the meta device,
    so torch's default init (for the embedding a serial ``normal_`` over vocab x hidden values)
    is not a wasted pass before it."""
    with torch.device("meta"):
        module = cls(*args, **kwargs)
    return _initialised(adapter, _bound(module, targets), name, targets)


def _bound(module: nn.Module, targets: dict[str, torch.Tensor]) -> nn.Module:
    """``module`` (on meta) on CPU with ``targets`` as its parameters: the init writes the
    store once, its pages faulted by the fill's threads, where a module of its own would be
    faulted, written and then copied (a sixth of the seeded init's time on 16 cores)."""
    module = module.to_empty(device="cpu")  # the buffers; the parameters' pages stay untouched
    bind_params(module, targets)
    return module


def init_weights(adapter: HFAdapter, store: HostStore, seed: int) -> None:
    """Seeded init from the config, one module at a time (embed, layers in order, norm, head),
    in place in the store's master; the normal draws on every core (``ParallelNormal``),
    seeded by the module's name."""
    torch.manual_seed(seed)  # any draw but normal_ (Qwen3.5-MoE's A_log: uniform_), seeded
    with ParallelNormal(seed, default_threads()) as draws:
        _init_modules(adapter, store, draws)


def _init_modules(adapter: HFAdapter, store: HostStore, draws: ParallelNormal) -> None:
    base = adapter.base
    draws.scope(_module(EMBED))
    weight = {"weight": store.param(EMBED)}
    _fresh(adapter, _module(EMBED), weight, nn.Embedding, adapter.vocab_size, adapter.hidden_size,
           adapter.padding_idx)  # fmt: skip
    for i in range(adapter.num_layers):
        draws.scope(f"model.layers.{i}")
        params = {
            local: store.param(full)
            for full, local in adapter.groups[adapter.layer_group(i)].params
        }
        _fresh(adapter, f"model.layers.{i}", params, type(base.layers[i]), adapter.config, i)
    draws.scope(_module(NORM))
    # the model's own norm class, copied (Gemma's takes other arguments than the config)
    weight = {"weight": store.param(NORM)}
    _initialised(adapter, _bound(copy.deepcopy(base.norm), weight), _module(NORM), weight)
    if not adapter.tied:
        draws.scope(_module(LM_HEAD))
        _fresh(adapter, _module(LM_HEAD), {"weight": store.param(LM_HEAD)}, nn.Linear,
               adapter.hidden_size, adapter.vocab_size, bias=False)  # fmt: skip


def fill_master(adapter: HFAdapter, store: HostStore, seed: int) -> str:
    """Load weights if the model directory has any, else init; returns which was done."""
    files = weight_files(adapter.path) if adapter.path is not None else []
    if files:
        plan = load_weights(adapter, store, files)
        return f"loaded {len(files)} safetensors file(s){plan.describe()}"
    init_weights(adapter, store, seed)
    return f"initialised from the config (seed {seed})"
