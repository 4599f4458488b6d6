"""A model directory without weights: the host state initialised from the config by the
model's own ``_init_weights`` (``io.hf_load.init_weights``), seeded, every tensor set, and no
wasted pass of torch's default init (the embedding's is a serial ``normal_`` over vocab x
hidden values: seconds per billion of them)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn

from engine.tiny import CONFIGS, MORE_CONFIGS, tiny_config
from slidedp.errors import ModelLoadError
from slidedp.io.hf_load import init_weights
from slidedp.models.hf import EMBED, HFAdapter
from slidedp.store import HostStore

ARCHS = sorted(set(CONFIGS) | set(MORE_CONFIGS))


def _config_dir(root: Path, arch: str, *, tied: bool) -> Path:
    path = root / arch
    config = tiny_config(arch, tied=tied, layers=2)
    config.pad_token_id = 3
    config.save_pretrained(path)
    return path


def _init(adapter: HFAdapter, seed: int) -> dict[str, torch.Tensor]:
    store = HostStore.create(adapter.group_specs(), staging_slots=2)
    init_weights(adapter, store, seed)
    return {n: store.param(n).clone() for _, n in adapter.iter_params()}


@pytest.mark.parametrize("arch", ARCHS)
def test_every_tensor_is_set_by_the_models_own_init_and_seeded(
    arch: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    adapter = HFAdapter.from_dir(_config_dir(tmp_path, arch, tied=False))  # its skeleton: meta

    def no_pass_on_real_memory(cls: type[nn.Linear] | type[nn.Embedding]) -> None:
        reset: Any = cls.reset_parameters

        def checked(self: nn.Linear | nn.Embedding) -> None:
            if self.weight.device.type != "meta":  # a pass over memory _init_weights redoes
                raise AssertionError(f"torch's default init of {type(self).__name__} ran")
            reset(self)

        monkeypatch.setattr(cls, "reset_parameters", checked)

    no_pass_on_real_memory(nn.Embedding)
    no_pass_on_real_memory(nn.Linear)
    first, again, other = _init(adapter, 0), _init(adapter, 0), _init(adapter, 1)
    assert all(torch.equal(first[n], again[n]) for n in first)
    embed = first[EMBED]
    assert not torch.equal(embed, other[EMBED])
    assert embed.std() > 0
    if adapter.padding_idx is not None:  # HF's one special case: the padding row is zero
        assert torch.count_nonzero(embed[adapter.padding_idx]) == 0
        assert torch.count_nonzero(embed[adapter.padding_idx - 1]) > 0


def _init_with_head(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, head: Any) -> None:
    """``init_weights`` of an untied Qwen3 whose ``_init_weights`` runs as ``head(init, self,
    module)`` says on the LM head (the model's own otherwise)."""
    adapter = HFAdapter.from_dir(_config_dir(tmp_path, "qwen3", tied=False))
    init: Any = type(adapter.skeleton)._init_weights

    def patched(self: nn.Module, module: nn.Module) -> None:
        if isinstance(module, nn.Linear) and module.out_features == adapter.vocab_size:
            head(init, self, module)
        else:
            init(self, module)

    monkeypatch.setattr(type(adapter.skeleton), "_init_weights", patched)
    init_weights(adapter, HostStore.create(adapter.group_specs(), staging_slots=2), 0)


def test_a_tensor_the_models_init_leaves_unset_is_one_error(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Built on the meta device, a module holds whatever memory it was given: one that
    ``_init_weights`` does not set is refused, never trained on."""
    with pytest.raises(ModelLoadError, match=r"does not initialise \['lm_head.weight'\]"):
        _init_with_head(tmp_path, monkeypatch, lambda init, self, module: None)


def test_a_parameter_the_models_init_replaces_is_one_error(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """An ``_init_weights`` that gives a parameter new memory instead of setting it would leave
    the store's view as it was: refused, naming it."""

    def replaces(init: Any, self: nn.Module, module: nn.Linear) -> None:
        init(self, module)
        module.weight = nn.Parameter(torch.zeros_like(module.weight))

    with pytest.raises(ModelLoadError, match=r"\['lm_head.weight \(replaced\)'\]"):
        _init_with_head(tmp_path, monkeypatch, replaces)


def test_the_init_writes_the_store_in_place(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Each module's parameters are the store's own views while ``_init_weights`` runs: no
    module-sized copy (one would fault and write every page of the weights twice)."""
    adapter = HFAdapter.from_dir(_config_dir(tmp_path, "qwen3", tied=False))
    copied: list[tuple[int, ...]] = []
    copy = torch.Tensor.copy_

    def counted(self: torch.Tensor, *args: Any, **kwargs: Any) -> torch.Tensor:
        if self.device.type != "meta":  # building the skeleton on meta costs nothing
            copied.append(tuple(self.shape))
        return copy(self, *args, **kwargs)

    monkeypatch.setattr(torch.Tensor, "copy_", counted)
    weights = _init(adapter, 0)
    assert copied == []
    assert all(torch.isfinite(w).all() for w in weights.values())
