"""A plan given to ``slidedp train --plan FILE``: its values become the run's config keys.

A plan (``Plan.to_json``) decides the run's device, dtype, policy, layer kernels, optimizer
settings, loss chunk, host threads and version timeout. ``take_plan`` writes each into the
config key that decides it (``runtime.device``, ``train.dtype``, ``runtime.layers``,
``train.adam_beta1``, ``runtime.update_threads``, ...), checked by the config's schema, so that
the config the run checks, records (``resolved_config.yaml``) and resolves its plan from
(``plan.resolve.resolve_plan``) is the plan. A key the config sets (to other than its default:
in the file or on the command line) to another value than the plan's is refused, as a policy
file's is: keep each key in one place. The launcher hands its decided plan to its ranks the
same way (``--plan``). Every problem is one ``ConfigError`` line naming the plan file.

Example::

    cfg, plan = take_plan(load_config("run.yaml"), Path("runs/x/plan.json"))
"""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any

import torch

from slidedp.config import TrainConfig, config_from_dict, config_to_dict
from slidedp.errors import ConfigError
from slidedp.models.fast import Compute
from slidedp.models.hf import HFAdapter
from slidedp.plan.layout import parse_layout
from slidedp.plan.policy import (
    OptimConfig,
    Plan,
    Policy,
    check_plan_format,
    counted_layers,
    policy_runtime_keys,
    read_plan_json,
)

_REWRITE = "write it again with `slidedp plan` (or use a run's OUTPUT/plan.json)"
_KEYS = {  # each part of a plan and its keys
    "plan": {"format"} | {f.name for f in dataclasses.fields(Plan)},
    "policy": {f.name for f in dataclasses.fields(Policy)},
    "policy.compute": {f.name for f in dataclasses.fields(Compute)},
    "optim": {f.name for f in dataclasses.fields(OptimConfig)},
}


def take_plan(cfg: TrainConfig, path: Path) -> tuple[TrainConfig, Plan]:
    """``cfg`` with the keys of the plan at ``path`` and the plan; refused in one line: a file
    that is not a plan, a value the config's schema refuses, a key the config sets otherwise,
    a device this machine lacks."""
    raw = read_plan_json(path)
    check_plan_format(raw, str(path))
    _check_parts(raw, path)
    keys = plan_keys(raw)
    try:
        ran = config_from_dict(_merged(config_to_dict(cfg), keys))
    except ConfigError as e:
        raise ConfigError(f"{path}: {'; '.join(e.problems)}: fix the plan, or {_REWRITE}") from None
    clashes = _clashes(cfg, ran, path)
    if clashes:
        raise ConfigError(
            f"{'; '.join(clashes)}: keep each key in one place (take it out of the config or "
            f"the command line to run the plan {path}, or write the plan again from this config)"
        )
    device = ran.runtime.launch.device
    if device == "cuda" and not torch.cuda.is_available():
        raise ConfigError(
            f"{path} runs on cuda (a plan for a GPU) and this machine has none: train it on "
            "its GPU, or write a plan for this machine with `slidedp plan`"
        )
    if ran.runtime.layout.kernels == "liger" and device != "cuda":
        raise ConfigError(f"{path} runs Liger kernels on {device}: they run on CUDA only")
    return ran, Plan.from_json(raw, str(path))


def check_plan_model(plan: Plan, source: str, adapter: HFAdapter) -> None:
    """A plan made for another model (another decoder layer count), or keeping more layers
    on the GPU than it has: one line."""
    layers, resident = len(plan.policy.layers), plan.policy.resident_layers
    if layers != adapter.num_layers:
        raise ConfigError(
            f"{source} was made for another model: its layout {plan.policy.layout} has "
            f"{layers} decoder layers, this model {adapter.num_layers}; write a plan for this "
            "model with `slidedp plan`"
        )
    if resident > layers:
        raise ConfigError(
            f"{source}: policy.resident_layers={resident} but its layout has {layers} decoder "
            f"layers: set 0..{layers}, or {_REWRITE}"
        )


def plan_keys(raw: dict[str, Any]) -> dict[str, dict[str, Any]]:
    """The config keys (by section) that decide what the plan ``raw`` (parts checked) says."""
    policy, optim = raw["policy"], raw["optim"]
    runtime = policy_runtime_keys(policy) | {
        "device": raw["device"],
        "loss_chunk_tokens": raw["loss_chunk_tokens"],
        "update_threads": 0 if raw["threads"] is None else raw["threads"],  # None: its share
        "version_timeout_s": raw["version_timeout_s"],
    }
    if "compute" in policy:  # a plan of an older run has none: the config's kernels run
        compute = policy["compute"]
        backend = compute["compile"]
        runtime |= {
            "kernels": compute["kernels"],
            "compile": backend != "" if isinstance(backend, str) else backend,
            "mlp_tile_tokens": compute["mlp_tile_tokens"],
        }
    beta1, beta2 = optim["betas"]
    train = {"dtype": raw["dtype"], "adam_beta1": beta1, "adam_beta2": beta2,
             "adam_epsilon": optim["eps"], "weight_decay": optim["weight_decay"],
             "max_grad_norm": optim["max_grad_norm"]}  # fmt: skip
    return {"runtime": runtime, "train": train}


def _check_parts(raw: dict[str, Any], path: Path) -> None:
    """Each part of the plan a mapping of its keys, none unknown, none missing (but the
    layer compute and the optional ``Compute.reason``), two betas; else one line."""
    parts = {"plan": raw, "policy": raw.get("policy"), "optim": raw.get("optim")}
    if isinstance(parts["policy"], dict) and "compute" in parts["policy"]:
        parts["policy.compute"] = parts["policy"]["compute"]
    for part, value in parts.items():
        if not isinstance(value, dict):
            raise ConfigError(f"{path}: '{part}' must be a mapping of its keys: {_REWRITE}")
        unknown = sorted(set(value) - _KEYS[part])
        missing = sorted(_KEYS[part] - set(value) - {"compute", "reason"})
        if unknown or missing:
            said = [
                f"unknown keys {unknown}" if unknown else "",
                f"no {missing}" if missing else "",
            ]
            raise ConfigError(
                f"{path}: '{part}' has {' and '.join(filter(None, said))}: {_REWRITE}"
            )
    betas = raw["optim"]["betas"]
    if not isinstance(betas, list) or len(betas) != 2:
        raise ConfigError(f"{path}: optim.betas must be [beta1, beta2], got {betas!r}")
    try:
        counted_layers(raw["policy"]["layers"])
    except (AttributeError, ValueError):
        raise ConfigError(
            f"{path}: policy.layers must count every layer (e.g. '2xF-r0, 1xN-r0'), got "
            f"{raw['policy']['layers']!r}: {_REWRITE}"
        ) from None


def _merged(config: dict[str, Any], keys: dict[str, dict[str, Any]]) -> dict[str, Any]:
    return config | {section: config[section] | given for section, given in keys.items()}


def _clashes(cfg: TrainConfig, ran: TrainConfig, path: Path) -> list[str]:
    """``section.key=CONFIG but PLAN runs VALUE`` for each key the plan decides that ``cfg``
    sets to another value than its default and the plan's (``ran``: ``cfg`` with the plan's
    keys); ``runtime.policy`` is the plan's to decide. The layers compare as the layout they
    describe (``offload_ratio`` fills the entries that give none)."""
    now, run = config_to_dict(cfg), config_to_dict(ran)
    default = {
        "runtime": config_to_dict(dataclasses.replace(cfg, runtime=type(cfg.runtime)()))["runtime"],
        "train": {f.name: f.default for f in dataclasses.fields(cfg.train)},
    }
    found = []
    for section in ("runtime", "train"):
        for key, value in run[section].items():
            was = now[section][key]
            layout = key in ("layers", "offload_ratio", "policy")
            if was != value and was != default[section][key] and not layout:
                found.append(f"{section}.{key}={was} but {path} runs {value}")
    if not _same_layout(cfg, ran):
        found.append(f"runtime.layers={cfg.runtime.layout.layers} "
                     f"(offload_ratio {cfg.runtime.layout.offload_ratio}) but {path} runs "
                     f"{ran.runtime.layout.layers}")  # fmt: skip
    return found


def _same_layout(cfg: TrainConfig, ran: TrainConfig) -> bool:
    """Whether ``cfg`` leaves the layout to the plan or describes the plan's (``ran``'s)."""
    mine, theirs = cfg.runtime.layout, ran.runtime.layout
    if (mine.layers, mine.offload_ratio) == ("F", 0.0):  # the defaults: the plan's to decide
        return True
    count = counted_layers(theirs.layers)
    try:
        ours = parse_layout(mine.layers, count, mine.offload_ratio)
    except ConfigError:
        return False
    return ours == parse_layout(theirs.layers, count, 0.0)
