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

import copy
import functools
import inspect
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any, cast

import torch
from torch import nn
from transformers import AutoConfig, AutoModelForCausalLM, PretrainedConfig, PreTrainedModel
from transformers.masking_utils import (
    create_causal_mask,
    create_recurrent_attention_mask,
    create_sliding_window_causal_mask,
)

from slidedp.errors import ModelLoadError
from slidedp.models.bind import bind_params
from slidedp.models.buffers import LayerBuffers, bind_buffers
from slidedp.models.fast import Compute, call_layer
from slidedp.models.hf_config import (
    apply_overrides,
    check_layer_count,
    check_sizes,
    unknown_model_type,
)
from slidedp.models.loss import chunked_lm_loss
from slidedp.models.router_loss import RouterLoss
from slidedp.store import GroupSpec, ParamSpec

# the decoder layer Llama's way (segment checkpointing cuts it: runtime.activations.segments)
SEGMENTABLE_MODEL_TYPES = ("llama", "mistral", "qwen2", "qwen3")
MOE_MODEL_TYPES = ("mixtral", "olmoe", "qwen3_moe", "qwen3_5_moe_text")
SUPPORTED_MODEL_TYPES = (*SEGMENTABLE_MODEL_TYPES, "gemma3_text", "gemma4_text", *MOE_MODEL_TYPES)
EMBED = "model.embed_tokens.weight"
NORM = "model.norm.weight"
LM_HEAD = "lm_head.weight"


@functools.cache
def no_cache(function: Callable[..., Any]) -> dict[str, None]:
    """The keyword telling ``function`` (a transformers mask builder or module ``forward``)
    "no cache": ``cache`` from transformers 5.24, which deprecates ``past_key_values`` (a
    warning, an error here), ``past_key_values`` before it."""
    accepted = inspect.signature(function).parameters
    return {"cache": None} if "cache" in accepted else {"past_key_values": None}


@dataclass(frozen=True)
class GroupNames:
    """One store group: its name and its parameters' full HF names with module-local names."""

    name: str
    params: tuple[tuple[str, str], ...]  # (full name, name local to the group's module)


# the multimodal models whose text model slidedp trains: their language model's weights
MULTIMODAL_TEXT_PREFIX = {"gemma4": "model.language_model.", "qwen3_5_moe": "model.language_model."}


def text_part(config: PretrainedConfig) -> tuple[PretrainedConfig, str]:
    """``(the text model's config, the prefix of its weights' names in the checkpoint)``: of a
    multimodal model, its ``text_config`` (tied as the multimodal model ties its LM head, by
    the top-level ``tie_word_embeddings``) and ``model.language_model.``; else
    ``(config, "")``."""
    prefix = MULTIMODAL_TEXT_PREFIX.get(config.model_type)
    if prefix is None:
        return config, ""
    text = config.get_text_config()
    text.tie_word_embeddings = bool(getattr(config, "tie_word_embeddings", False))
    return text, prefix


def refuse_unstreamable(config: PretrainedConfig) -> None:
    """A config whose layers cannot be streamed one at a time: ModelLoadError naming the
    feature and its config key."""
    per_layer_input = getattr(config, "hidden_size_per_layer_input", 0) or 0
    if per_layer_input:
        raise ModelLoadError(
            f"model type '{config.model_type}' with per-layer input embeddings "
            f"(hidden_size_per_layer_input={per_layer_input}): they are computed outside the "
            "decoder layers from a second embedding table, which slidedp does not stream; "
            "not supported"
        )
    shared = getattr(config, "num_kv_shared_layers", 0) or 0
    if shared:
        raise ModelLoadError(
            f"model type '{config.model_type}' with keys and values shared across layers "
            f"(num_kv_shared_layers={shared}): a layer would read another layer's attention "
            "state, which slidedp's one-layer-at-a-time recompute cannot keep; not supported"
        )


class HFAdapter:
    """Layer discovery, tied weights, rotary embeddings and masks of one HF causal LM."""

    def __init__(self, config: PretrainedConfig, path: Path | None = None) -> None:
        self.multimodal: str | None = (
            config.model_type if config.model_type in MULTIMODAL_TEXT_PREFIX else None
        )
        config, self.weight_prefix = text_part(config)
        refuse_unstreamable(config)
        if config.model_type not in SUPPORTED_MODEL_TYPES:
            raise ModelLoadError(
                f"model type '{config.model_type}' is not supported "
                f"(supported: {', '.join(SUPPORTED_MODEL_TYPES)})"
            )
        if getattr(config, "use_bidirectional_attention", False):
            raise ModelLoadError(
                f"model type '{config.model_type}' with use_bidirectional_attention is not a "
                "causal LM; set it to false"
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
        self.segmentable = config.model_type in SEGMENTABLE_MODEL_TYPES
        # experts in the layers (Gemma 4's beside its MLP where enable_moe_block is set)
        self.moe = config.model_type in MOE_MODEL_TYPES or bool(
            getattr(config, "enable_moe_block", False)
        )
        self.softcap: float | None = getattr(self.config, "final_logit_softcapping", None)
        # the decoder layer's own keyword arguments (they differ: Gemma's take no use_cache)
        self._layer_args = set(inspect.signature(type(self.base.layers[0]).forward).parameters)
        missing = {"attention_mask", "position_embeddings"} - self._layer_args
        if missing:
            raise ModelLoadError(
                f"model type '{config.model_type}': this transformers' decoder layer takes no "
                f"{', '.join(sorted(missing))}; install a transformers this slidedp supports"
            )
        # the load-balancing loss is in the loss where transformers adds it
        self.router_loss: RouterLoss | None = None
        self._routers: list[list[nn.Module]] = [[] for _ in range(self.num_layers)]
        if config.model_type in MOE_MODEL_TYPES and getattr(config, "output_router_logits", False):
            self.router_loss = RouterLoss.of(skeleton)
            self._routers = [[m for m in layer.modules() if isinstance(m, self.router_loss.router)]
                             for layer in self.base.layers]  # fmt: skip
        self.groups = self._groups()
        self.buffers = LayerBuffers.of(skeleton, self.base.layers)  # Gemma 4's layer_scalar
        self.layer_kinds = self._layer_kinds()
        # how a decoder layer module is called: eager, or compiled (models.fast.apply_compute)
        self.layer_call: Callable[[nn.Module, torch.Tensor, dict[str, Any]], Any] = call_layer
        self.compute: Compute | None = None  # what apply_compute patched in (None: not yet)
        # stored parameters that never train (train.freeze: models.freeze.apply_freeze)
        self.frozen: frozenset[str] = frozenset()

    @classmethod
    def from_dir(cls, path: str | Path, overrides: dict[str, Any] | None = None) -> HFAdapter:
        """The model of ``path/config.json`` (of a multimodal model, its text model) with
        ``overrides`` (``ModelSection.config_overrides``: ``rope_scaling``,
        ``max_position_embeddings``, ``output_router_logits``) applied to its config first."""
        path = Path(path)
        try:
            found = (path / "config.json").is_file()
        except OSError as e:  # a directory this user may not search
            raise ModelLoadError(
                f"cannot read {path}: {e.strerror}; fix the model directory's permissions"
            ) from None
        if not found:
            raise ModelLoadError(f"{path} has no config.json (expected an HF model directory)")
        check_layer_count(path / "config.json")
        try:
            config = AutoConfig.from_pretrained(path)
        except Exception as e:  # bad JSON, or transformers' checks of the fields' types
            unknown = unknown_model_type(path / "config.json")
            if unknown is not None:  # transformers' own line suggests upgrading it
                raise ModelLoadError(
                    f"model type '{unknown}' is not supported "
                    f"(supported: {', '.join(SUPPORTED_MODEL_TYPES)})"
                ) from None
            what = " ".join(str(e).split()) or type(e).__name__
            raise ModelLoadError(
                f"cannot read {path}/config.json: {what}; fix the file or re-download the model"
            ) from None
        text = config.get_text_config()  # a multimodal model's text_config, else config
        try:
            apply_overrides(text, overrides or {})
        except Exception as e:  # transformers' checks of the rope parameters
            what = " ".join(str(e).split()) or type(e).__name__
            raise ModelLoadError(f"model overrides {overrides} do not apply: {what}") from None
        check_sizes(path / "config.json", text)
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

    def _layer_kinds(self) -> list[int]:
        """Per decoder layer, the first layer of its kind: the same module class with the same
        parameters (names and shapes). Layers of a kind cost the same; a model may mix kinds
        (Gemma 4's full-attention layers are wider, Qwen3.5's linear-attention layers hold
        other parameters, Qwen3-MoE's ``mlp_only_layers`` are dense)."""
        first: dict[tuple[Any, ...], int] = {}
        kinds = []
        for i, layer in enumerate(self.base.layers):
            params = tuple((n, tuple(p.shape)) for n, p in layer.named_parameters())
            kinds.append(first.setdefault((type(layer).__name__, params), i))
        return kinds

    def stored_name(self, name: str) -> str | None:
        """A checkpoint tensor's name as a name of the model (None: not the text model's,
        e.g. a multimodal model's vision tower, skipped)."""
        if not self.weight_prefix or name == LM_HEAD:
            return name
        if name.startswith(self.weight_prefix):
            return "model." + name.removeprefix(self.weight_prefix)
        return None

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
            GroupSpec(
                g.name,
                [ParamSpec(full, shapes[full], frozen=full in self.frozen) for full, _ in g.params],
            )
            for g in self.groups
        ]

    def frozen_locals(self, group: int) -> frozenset[str]:
        """Group ``group``'s frozen parameters by their names inside its module."""
        return frozenset(local for full, local in self.groups[group].params if full in self.frozen)

    def trains(self, group: int) -> bool:
        """Whether any parameter of group ``group`` trains."""
        return any(full not in self.frozen for full, _ in self.groups[group].params)

    def layer_module(self, layer: int) -> nn.Module:
        return cast(nn.Module, self.base.layers[layer])

    def run_layer(
        self,
        layer: int,
        params: dict[str, torch.Tensor],
        x: torch.Tensor,
        ctx: dict[str, Any],
        *,
        eager: bool = False,
    ) -> tuple[torch.Tensor, tuple[torch.Tensor, ...]]:
        """Decoder layer ``layer`` on ``x`` [B, S, H] with its parameters bound to ``params``
        (module-local names); ``ctx`` holds ``masks`` and ``position_embeddings`` (per layer)
        and ``position_ids``. No cache: training recomputes, it never decodes. Returns the
        output [B, S, H] and the layer's router logits ([B*S, experts] each, recorded as
        transformers records them) when the loss has a load-balancing term, else ``()``.
        ``eager``: call the module itself even when layers are compiled (``layer_call``)."""
        module = self.layer_module(layer)
        bind_params(module, params)
        bind_buffers(module, self.buffers.on(layer, x.device, x.dtype))
        kwargs = {
            "attention_mask": ctx["masks"][layer],
            "position_ids": ctx["position_ids"],
            "position_embeddings": ctx["position_embeddings"][layer],
            **no_cache(type(module).forward),
            "use_cache": False,
            # Gemma 4 (transformers 5.17) has the last layer of each attention type store its
            # keys and values here even when no layer reuses them: the forward's own dict
            "shared_kv_states": {},
        }
        recorded: list[torch.Tensor] = []
        hooks = []
        if self.router_loss is not None:
            index = self.router_loss.index
            hooks = [r.register_forward_hook(lambda _m, _i, out: recorded.append(out[index]))
                     for r in self._routers[layer]]  # fmt: skip
        try:
            args = {k: v for k, v in kwargs.items() if k in self._layer_args}
            out = (call_layer if eager else self.layer_call)(module, x, args)
        finally:
            for hook in hooks:
                hook.remove()
        result: torch.Tensor = out[0] if isinstance(out, tuple) else out
        return result, tuple(recorded)

    def head_loss(
        self,
        x: torch.Tensor,  # [B, S, H] output of the last layer
        norm_w: torch.Tensor,  # [H] final norm weight
        head_w: torch.Tensor,  # [V, H] LM head (the embedding when tied)
        targets: torch.Tensor,  # [B, S] shifted labels
        n_labels: int,
        chunk_tokens: int,
        needs: tuple[bool, bool, bool] = (True, True, True),
    ) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor | None, torch.Tensor | None]:
        """Final norm + chunked linear/CE with its backward: ``(loss sum, d/dx, d/d norm_w,
        d/d head_w)`` for the mean over ``n_labels`` label tokens. ``needs``: which of the three
        gradients to compute (the others are None: frozen weights, nothing trained below)."""
        need_x, need_norm, need_head = needs
        x_last = x.detach().requires_grad_(need_x)
        norm_w = norm_w.detach().requires_grad_(need_norm)
        bind_params(self.norm_module(), {"weight": norm_w})
        with torch.enable_grad():
            normed = self.norm_module()(x_last)  # [B, S, H]
        loss_sum, g_normed, g_head_w = chunked_lm_loss(
            normed.detach(), head_w, targets, n_labels, chunk_tokens, softcap=self.softcap,
            weight_grad=need_head, hidden_grad=need_x or need_norm,
        )  # fmt: skip
        wanted = [t for t, need in ((x_last, need_x), (norm_w, need_norm)) if need]
        grads = iter(torch.autograd.grad(normed, wanted, g_normed) if wanted else ())
        g_x = next(grads) if need_x else None
        g_norm_w = next(grads) if need_norm else None
        return loss_sum, g_x, g_norm_w, g_head_w

    def make_embed(self, device: torch.device) -> nn.Module:
        """The model's own embedding module on ``device`` (Gemma's scales by sqrt(hidden)),
        its weight bound at each use (``embed``): a copy of the skeleton's with a 0-row
        placeholder weight, its buffers filled by transformers' ``_init_weights``."""
        embed = copy.deepcopy(self.base.embed_tokens)
        embed.weight = nn.Parameter(torch.empty(0, self.hidden_size, device="meta"))
        embed = embed.to_empty(device=device)
        padding, embed.padding_idx = embed.padding_idx, None  # the placeholder has no rows
        self.skeleton._init_weights(embed)  # type: ignore[no-untyped-call]
        embed.padding_idx = padding
        return cast(nn.Module, embed)

    def embed(self, module: nn.Module, ids: torch.Tensor, embed_w: torch.Tensor) -> torch.Tensor:
        """The embedding module ``module`` (``make_embed``) of ``ids`` [B, S] with weight
        ``embed_w`` [V, H]: [B, S, H]."""
        bind_params(module, {"weight": embed_w})
        out: torch.Tensor = module(ids)
        return out

    def embed_backward(
        self,
        module: nn.Module,  # make_embed's
        ids: torch.Tensor,  # [B, S] token ids
        embed_w: torch.Tensor,  # [V, H]
        g_x: torch.Tensor,  # [B, S, H] d loss / d embedding output
        g_head_w: torch.Tensor | None,  # [V, H] the LM head's gradient (needed when tied)
    ) -> torch.Tensor:
        """d loss / d embedding weight (plus the head's gradient when the two are tied)."""
        w = embed_w.detach().requires_grad_(True)
        with torch.enable_grad():
            emb = self.embed(module, ids, w)
        (g_embed,) = torch.autograd.grad(emb, w, g_x)
        if not self.tied:
            return g_embed
        assert g_head_w is not None, "a tied embedding that trains: its head's gradient too"
        return g_embed + g_head_w

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

    def position_embeddings(
        self, rotary: nn.Module, x: torch.Tensor, position_ids: torch.Tensor
    ) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """Each decoder layer's rotary (cos, sin), as the model's forward computes them: one
        pair for every layer, or one per layer type where the rotary module takes one (Gemma's
        sliding and full attention layers rotate with different bases)."""
        if hasattr(rotary, "mrope_section"):  # Qwen3.5: one row per grid axis, as its forward
            position_ids = position_ids[None].expand(3, *position_ids.shape)
        if "layer_type" not in inspect.signature(rotary.forward).parameters:
            return [rotary(x, position_ids)] * self.num_layers
        kinds = self.config.layer_types[: self.num_layers]
        by_kind = {kind: rotary(x, position_ids, kind) for kind in set(kinds)}
        return [by_kind[kind] for kind in kinds]

    def layer_masks(
        self,
        inputs_embeds: torch.Tensor,  # [B, S, H]
        attention_mask: torch.Tensor | None,  # [B, S] 1 = token, 0 = padding; None: packed
        position_ids: torch.Tensor,  # [1, S], or [B, S] restarting per packed sample
    ) -> list[Any]:
        """The attention mask of each decoder layer, built by transformers' own mask functions
        with the same rule as the model's forward (per ``layer_types``, else Mistral-style
        sliding window when ``config.sliding_window`` is set, else causal); a linear-attention
        layer's is the [B, S] padding mask (None unpadded), which zeroes padded states."""
        kwargs: dict[str, Any] = {
            "config": self.config,
            "inputs_embeds": inputs_embeds,
            "attention_mask": attention_mask,
            "position_ids": position_ids,
        }
        layer_types = getattr(self.config, "layer_types", None)
        if not layer_types:
            sliding = getattr(self.config, "sliding_window", None) is not None
            kind = "sliding_attention" if sliding else "full_attention"
            layer_types = [kind] * self.num_layers
        makers: dict[str, Callable[..., Any]] = {
            "full_attention": create_causal_mask,
            "sliding_attention": create_sliding_window_causal_mask,
            "linear_attention": create_recurrent_attention_mask,
        }
        masks: dict[str, Any] = {}
        for kind in set(layer_types):
            if kind not in makers:
                raise ModelLoadError(f"unsupported attention layer type '{kind}'")
            masks[kind] = makers[kind](**kwargs, **no_cache(makers[kind]))
        return [masks[kind] for kind in layer_types[: self.num_layers]]
