"""Binding tensors to a module skeleton's parameters without copying (the layers' weights live
in the window's slots; a module is structure only)."""

from __future__ import annotations

from typing import cast

import torch
from torch import nn


def bind_params(module: nn.Module, tensors: dict[str, torch.Tensor]) -> None:
    """Point ``module``'s parameters (local dotted names) at ``tensors`` without copying."""
    for local, tensor in tensors.items():
        path, _, attr = local.rpartition(".")
        owner = module.get_submodule(path) if path else module
        owner._parameters[attr] = cast(nn.Parameter, tensor)
