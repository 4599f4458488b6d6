"""HF decoder-only causal LMs seen as groups of parameters: ``embed``, ``layers.{i}``, ``head``.

The model is built once on the ``meta`` device (``AutoModelForCausalLM.from_config``): it gives
transformers' own decoder-layer modules, rotary module and mask rules without allocating a
single weight. The runtime binds a layer module's parameters to views of a device slot just
before running it (``bind_params``), so the modules are structure only and numerics are
transformers' own.

Example::

    adapter = HFAdapter.from_dir("/models/qwen3-0.6b")
    store = HostStore.create(adapter.group_specs(), staging_slots=2, grad_dtype="f32")
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any, cast

import torch
import torch.nn.functional as F
from torch import nn
from transformers import AutoConfig, AutoModelForCausalLM, PretrainedConfig, PreTrainedModel
from transformers.masking_utils import create_causal_mask, create_sliding_window_causal_mask

from slidedp.errors import ModelLoadError
from slidedp.models.loss import chunked_lm_loss
from slidedp.store import GroupSpec, ParamSpec

SUPPORTED_MODEL_TYPES = ("llama", "mistral", "qwen2", "qwen3")
# sizes a config.json may get wrong without a type error (a negative size fails deep in torch)
_SIZE_FIELDS = (
    "vocab_size",
    "hidden_size",
    "intermediate_size",
    "num_hidden_layers",
    "num_attention_heads",
    "num_key_value_heads",
    "head_dim",
)
EMBED = "model.embed_tokens.weight"
NORM = "model.norm.weight"
LM_HEAD = "lm_head.weight"


def bind_params(module: nn.Module, tensors: dict[str, torch.Tensor]) -> None:
    """Point ``module``'s parameters (local dotted names) at ``tensors`` without copying."""
    for local, tensor in tensors.items():
        path, _, attr = local.rpartition(".")
        owner = module.get_submodule(path) if path else module
        owner._parameters[attr] = cast(nn.Parameter, tensor)


@dataclass(frozen=True)
class GroupNames:
    """One store group: its name and its parameters' full HF names with module-local names."""

    name: str
    params: tuple[tuple[str, str], ...]  # (full name, name local to the group's module)


class HFAdapter:
    """Layer discovery, tied weights, rotary embeddings and masks of one HF causal LM."""

    def __init__(self, config: PretrainedConfig, path: Path | None = None) -> None:
        if config.model_type not in SUPPORTED_MODEL_TYPES:
            raise ModelLoadError(
                f"model type '{config.model_type}' is not supported "
                f"(supported: {', '.join(SUPPORTED_MODEL_TYPES)})"
            )
        self.path = path
        with torch.device("meta"):
            skeleton = AutoModelForCausalLM.from_config(config)  # type: ignore[no-untyped-call]
        self.skeleton: PreTrainedModel = skeleton.train()
        self.config: PretrainedConfig = skeleton.config
        self.base: Any = skeleton.model  # the decoder (LlamaModel, Qwen3Model, ...)
        self.tied = skeleton.lm_head.weight is self.base.embed_tokens.weight
        self.num_layers = len(self.base.layers)
        self.padding_idx: int | None = self.base.embed_tokens.padding_idx
        self.vocab_size = int(self.base.embed_tokens.num_embeddings)
        self.hidden_size = int(self.base.embed_tokens.embedding_dim)
        self.groups = self._groups()

    @classmethod
    def from_dir(cls, path: str | Path) -> HFAdapter:
        path = Path(path)
        if not (path / "config.json").is_file():
            raise ModelLoadError(f"{path} has no config.json (expected an HF model directory)")
        try:
            config = AutoConfig.from_pretrained(path)
        except Exception as e:  # bad JSON, or transformers' checks of the fields' types
            what = " ".join(str(e).split()) or type(e).__name__
            raise ModelLoadError(
                f"cannot read {path}/config.json: {what}; fix the file or re-download the model"
            ) from None
        for field in _SIZE_FIELDS:
            value = getattr(config, field, None)
            if isinstance(value, int) and not isinstance(value, bool) and value < 1:
                raise ModelLoadError(
                    f"{path}/config.json: '{field}' is {value}, it must be >= 1; fix the field "
                    "or re-download the model"
                )
        try:
            return cls(config, path)
        except ModelLoadError:
            raise
        except Exception as e:  # a field transformers accepted but cannot build with
            what = " ".join(str(e).split()) or type(e).__name__
            raise ModelLoadError(
                f"{path}/config.json does not describe a buildable model ({what}); fix the "
                "field or re-download the model"
            ) from None

    def _groups(self) -> list[GroupNames]:
        groups = [GroupNames("embed", ((EMBED, "weight"),))]
        for i, layer in enumerate(self.base.layers):
            local = [n for n, _ in layer.named_parameters()]
            groups.append(
                GroupNames(f"layers.{i}", tuple((f"model.layers.{i}.{n}", n) for n in local))
            )
        head = [(NORM, "weight")] + ([] if self.tied else [(LM_HEAD, "weight")])
        groups.append(GroupNames("head", tuple(head)))
        return groups

    @property
    def embed_group(self) -> int:
        return 0

    @property
    def head_group(self) -> int:
        return self.num_layers + 1

    def layer_group(self, layer: int) -> int:
        return layer + 1

    def shapes(self) -> dict[str, tuple[int, ...]]:
        """Every stored parameter's shape by full HF name (tied LM head not listed)."""
        named = dict(self.skeleton.named_parameters())
        return {full: tuple(named[full].shape) for g in self.groups for full, _ in g.params}

    def group_specs(self) -> list[GroupSpec]:
        shapes = self.shapes()
        return [
            GroupSpec(g.name, [ParamSpec(full, shapes[full]) for full, _ in g.params])
            for g in self.groups
        ]

    def layer_module(self, layer: int) -> nn.Module:
        return cast(nn.Module, self.base.layers[layer])

    def run_layer(
        self, layer: int, params: dict[str, torch.Tensor], x: torch.Tensor, ctx: dict[str, Any]
    ) -> torch.Tensor:
        """Decoder layer ``layer`` on ``x`` [B, S, H] with its parameters bound to ``params``
        (module-local names); ``ctx`` holds ``masks`` (per layer), ``position_ids`` and
        ``position_embeddings``. No cache: training recomputes, it never decodes."""
        module = self.layer_module(layer)
        bind_params(module, params)
        out = module(
            x,
            attention_mask=ctx["masks"][layer],
            position_ids=ctx["position_ids"],
            position_embeddings=ctx["position_embeddings"],
            past_key_values=None,
            use_cache=False,
        )
        result: torch.Tensor = out[0] if isinstance(out, tuple) else out
        return result

    def head_loss(
        self,
        x: torch.Tensor,  # [B, S, H] output of the last layer
        norm_w: torch.Tensor,  # [H] final norm weight
        head_w: torch.Tensor,  # [V, H] LM head (the embedding when tied)
        targets: torch.Tensor,  # [B, S] shifted labels
        n_labels: int,
        chunk_tokens: int,
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
        """Final norm + chunked linear/CE with its backward: ``(loss sum, d/dx, d/d norm_w,
        d/d head_w)`` for the mean over ``n_labels`` label tokens."""
        x_last = x.detach().requires_grad_(True)
        norm_w = norm_w.detach().requires_grad_(True)
        bind_params(self.norm_module(), {"weight": norm_w})
        with torch.enable_grad():
            normed = self.norm_module()(x_last)  # [B, S, H]
        loss_sum, g_normed, g_head_w = chunked_lm_loss(
            normed.detach(), head_w, targets, n_labels, chunk_tokens
        )
        g_x, g_norm_w = torch.autograd.grad(normed, (x_last, norm_w), g_normed)
        return loss_sum, g_x, g_norm_w, g_head_w

    def embed_backward(
        self,
        ids: torch.Tensor,  # [B, S] token ids
        embed_w: torch.Tensor,  # [V, H]
        g_x: torch.Tensor,  # [B, S, H] d loss / d embedding output
        g_head_w: torch.Tensor,  # [V, H] the LM head's gradient (used when tied)
    ) -> torch.Tensor:
        """d loss / d embedding weight (plus the head's gradient when the two are tied)."""
        w = embed_w.detach().requires_grad_(True)
        with torch.enable_grad():
            emb = F.embedding(ids, w, self.padding_idx)
        (g_embed,) = torch.autograd.grad(emb, w, g_x)
        return g_embed + g_head_w if self.tied else g_embed

    def norm_module(self) -> nn.Module:
        return cast(nn.Module, self.base.norm)

    def iter_params(self) -> Iterator[tuple[int, str]]:
        """(group index, full name) for every stored parameter, in group order."""
        for gi, g in enumerate(self.groups):
            for full, _ in g.params:
                yield gi, full

    def make_rotary(self, device: torch.device) -> nn.Module:
        """The model's own rotary module, built on CPU (as ``from_pretrained`` does) then moved."""
        rotary_cls = type(self.base.rotary_emb)
        with torch.device("cpu"):
            rotary = rotary_cls(config=self.config)
        return cast(nn.Module, rotary.to(device))

    def layer_masks(
        self,
        inputs_embeds: torch.Tensor,  # [B, S, H]
        attention_mask: torch.Tensor | None,  # [B, S] 1 = token, 0 = padding; None: packed
        position_ids: torch.Tensor,  # [1, S], or [B, S] restarting per packed sample
    ) -> list[Any]:
        """The attention mask of each decoder layer, built by transformers' own mask functions
        with the same rule as the model's forward (per ``layer_types``, else Mistral-style
        sliding window when ``config.sliding_window`` is set, else causal)."""
        kwargs: dict[str, Any] = {
            "config": self.config,
            "inputs_embeds": inputs_embeds,
            "attention_mask": attention_mask,
            "past_key_values": None,
            "position_ids": position_ids,
        }
        layer_types = getattr(self.config, "layer_types", None)
        if not layer_types:
            sliding = getattr(self.config, "sliding_window", None) is not None
            kind = "sliding_attention" if sliding else "full_attention"
            layer_types = [kind] * self.num_layers
        makers = {
            "full_attention": create_causal_mask,
            "sliding_attention": create_sliding_window_causal_mask,
        }
        masks: dict[str, Any] = {}
        for kind in set(layer_types):
            if kind not in makers:
                raise ModelLoadError(f"unsupported attention layer type '{kind}'")
            masks[kind] = makers[kind](**kwargs)
        return [masks[kind] for kind in layer_types[: self.num_layers]]
