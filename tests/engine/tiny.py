"""Tiny HF models, JSONL data, YAML configs and a plain PyTorch reference trainer for the tests.

The reference is HF Trainer's inner loop written out: the transformers model on the whole
global batch (loss = mean over label tokens), ``clip_grad_norm_``, ``torch.optim.AdamW`` with
HF's decay grouping (``Trainer.get_decay_parameter_names``), ``get_scheduler``. For a mixture of
experts the loss is the model's own with ``output_router_logits`` (the tiny MoE configs set it):
transformers adds ``router_aux_loss_coef * aux_loss`` to the token loss itself.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
import yaml
from safetensors.torch import load_file, save_file
from torch import nn
from transformers import (
    AutoModelForCausalLM,
    Gemma3TextConfig,
    Gemma4TextConfig,
    LlamaConfig,
    MixtralConfig,
    OlmoeConfig,
    PretrainedConfig,
    Qwen2Config,
    Qwen3Config,
    Qwen3MoeConfig,
    get_scheduler,
)
from transformers.models.qwen3_5_moe import Qwen3_5MoeTextConfig
from transformers.trainer_pt_utils import get_parameter_names
from transformers.utils import logging as hf_logging

hf_logging.disable_progress_bar()  # type: ignore[no-untyped-call]

CONFIGS: dict[str, type[PretrainedConfig]] = {
    "qwen3": Qwen3Config,
    "llama": LlamaConfig,
    "qwen2": Qwen2Config,
}
# the other architectures, each with what makes it differ: experts routed top-2 with the
# load-balancing loss on (a coefficient large enough to move the parameters measurably), a
# dense layer between MoE ones (Qwen3-MoE's mlp_only_layers); Gemma 3's sliding layers with a
# window shorter than the sequences, its final logit soft-capping; layers of two kinds (the
# last full attention): Gemma 4's wider full-attention heads sharing k and v, Qwen3.5-MoE's
# linear-attention layers beside gated full attention, each an MoE with a shared expert
MORE_CONFIGS: dict[str, tuple[type[PretrainedConfig], dict[str, Any]]] = {
    "qwen3_moe": (
        Qwen3MoeConfig,
        {"num_experts": 8, "num_experts_per_tok": 2, "moe_intermediate_size": 32,
         "mlp_only_layers": [1], "output_router_logits": True, "router_aux_loss_coef": 0.05},
    ),
    "mixtral": (
        MixtralConfig,
        {"num_local_experts": 4, "num_experts_per_tok": 2, "output_router_logits": True,
         "router_aux_loss_coef": 0.05},
    ),
    "olmoe": (  # more than 10 experts: the hub's expert names sort apart from their order
        OlmoeConfig,
        {"num_experts": 12, "num_experts_per_tok": 2, "intermediate_size": 32,
         "output_router_logits": True, "router_aux_loss_coef": 0.05, "eos_token_id": 2},
    ),
    "gemma3_text": (
        Gemma3TextConfig,
        {"sliding_window": 8, "layer_types": ["sliding_attention", "full_attention"],
         "final_logit_softcapping": 30.0, "query_pre_attn_scalar": 16},
    ),
    "gemma4_text": (
        Gemma4TextConfig,
        {"sliding_window": 8,
         "layer_types": ["sliding_attention", "sliding_attention", "full_attention"],
         "final_logit_softcapping": 30.0, "head_dim": 8, "global_head_dim": 16,
         "attention_k_eq_v": True, "num_global_key_value_heads": 1,
         "hidden_size_per_layer_input": 0},
    ),
    "gemma4_text_moe": (  # its layers' MLP beside experts, routed by its own router
        Gemma4TextConfig,
        {"sliding_window": 8,
         "layer_types": ["sliding_attention", "sliding_attention", "full_attention"],
         "final_logit_softcapping": 30.0, "head_dim": 8, "global_head_dim": 16,
         "attention_k_eq_v": True, "num_global_key_value_heads": 1,
         "hidden_size_per_layer_input": 0, "enable_moe_block": True, "num_experts": 4,
         "top_k_experts": 2, "moe_intermediate_size": 32},
    ),
    "qwen3_5_moe_text": (
        Qwen3_5MoeTextConfig,
        {"layer_types": ["linear_attention", "full_attention"], "num_experts": 8,
         "num_experts_per_tok": 2, "moe_intermediate_size": 32,
         "shared_expert_intermediate_size": 48, "linear_num_key_heads": 2,
         "linear_num_value_heads": 4, "linear_key_head_dim": 16, "linear_value_head_dim": 8,
         "output_router_logits": True, "router_aux_loss_coef": 0.05},
    ),
}  # fmt: skip
VOCAB = 256


def tiny_config(
    arch: str, *, tied: bool, layers: int, kv_heads: int | None = None
) -> PretrainedConfig:
    """A tiny config of ``arch`` (``CONFIGS`` or ``MORE_CONFIGS``) with ``layers`` layers and
    ``kv_heads`` key/value heads (default 2 of the 4 query heads; 4: a split in 4 by heads)."""
    cls, extra = MORE_CONFIGS.get(arch, (CONFIGS.get(arch), {}))
    assert cls is not None, f"no tiny config for {arch}"
    if "layer_types" in extra:  # the pattern repeated over the layers
        kinds = extra["layer_types"]
        extra = extra | {"layer_types": [kinds[i % len(kinds)] for i in range(layers)]}
    sizes = {"hidden_size": 64, "num_attention_heads": 4, "num_key_value_heads": 2,
             "head_dim": 16, "intermediate_size": 128}  # fmt: skip
    if kv_heads is not None:
        sizes["num_key_value_heads"] = kv_heads
    return cls(  # type: ignore[call-arg]
        num_hidden_layers=layers,
        vocab_size=VOCAB,
        max_position_embeddings=128,
        tie_word_embeddings=tied,
        **(sizes | extra),
    )


def make_model(
    root: Path,
    arch: str,
    *,
    tied: bool,
    layers: int = 2,
    seed: int = 0,
    per_expert: bool = False,
    kv_heads: int | None = None,
) -> Path:
    """A random tiny model saved with ``save_pretrained`` (safetensors) under ``root/arch``. A
    mixture of experts is saved with its fused expert parameters, as the model holds them, or
    with ``per_expert`` as ``save_pretrained`` writes it: one tensor per expert, the hub's
    layout (``slidedp.io.hub_experts``); transformers and slidedp load both. ``kv_heads``:
    ``tiny_config``'s."""
    config = tiny_config(arch, tied=tied, layers=layers, kv_heads=kv_heads)
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config)  # type: ignore[no-untyped-call]
    for name, buffer in model.named_buffers():
        if name.endswith("layer_scalar"):  # Gemma 4's: not 1, so that loading it matters
            buffer.fill_(0.5 + 0.25 * int(name.split(".")[2]))
    kv = "" if kv_heads is None else f"-kv{kv_heads}"
    path = root / f"{arch}-{'tied' if tied else 'untied'}-{layers}{'-hub' * per_expert}{kv}"
    model.save_pretrained(path)
    if hasattr(config, "router_aux_loss_coef") and not per_expert:
        # save_pretrained wrote the hub's layout; over it, the model's own fused parameters
        state = {n: t.contiguous() for n, t in model.state_dict().items()}
        if tied:
            del state["lm_head.weight"]
        save_file(state, path / "model.safetensors", metadata={"format": "pt"})
    return path


def write_data(path: Path, n: int, *, seed: int = 1, min_len: int = 6, max_len: int = 24) -> Path:
    """``n`` JSONL lines of random token ids of varying length (so batches need padding)."""
    gen = torch.Generator().manual_seed(seed)
    with path.open("w") as f:
        for _ in range(n):
            length = int(torch.randint(min_len, max_len + 1, (1,), generator=gen))
            ids = torch.randint(0, VOCAB, (length,), generator=gen).tolist()
            f.write(json.dumps({"input_ids": ids}) + "\n")
    return path


def write_config(path: Path, model: Path, data_path: Path, out: Path, /, **sections: Any) -> Path:
    """A config YAML; ``sections`` (e.g. ``data={"packing": True}``) update the defaults."""
    raw: dict[str, Any] = {
        "model": {"path": str(model)},
        "data": {"path": str(data_path), "seq_len": 32, "pad_id": 0},  # the models define no pad
        "train": {"max_steps": 3, "global_batch_size": 4, "learning_rate": 1e-3},
        "output": {"dir": str(out)},
        "runtime": {"device": "cpu"},  # CPU tests stay on CPU on a GPU machine too
    }
    for section, values in sections.items():
        raw.setdefault(section, {}).update(values)
    path.write_text(yaml.safe_dump(raw))
    return path


def read_metrics(out: Path) -> list[dict[str, Any]]:
    return [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]


def final_param_delta(one: Path, two: Path) -> float:
    """The largest |difference| between two runs' final parameters (the same names in both)."""
    p1 = load_file(one / "final" / "model.safetensors")
    p2 = load_file(two / "final" / "model.safetensors")
    assert set(p1) == set(p2)
    return max((p1[n] - p2[n]).abs().max().item() for n in p1)


def reference_batches(data: Path, batch_size: int, steps: int) -> list[dict[str, torch.Tensor]]:
    """Independent of slidedp.data: file order, right padding with 0, labels -100 on padding."""
    seqs = [json.loads(line)["input_ids"] for line in data.read_text().splitlines()]
    batches = []
    for t in range(steps):
        rows = [seqs[(t * batch_size + i) % len(seqs)] for i in range(batch_size)]
        width = max(len(r) for r in rows)
        ids = torch.zeros(batch_size, width, dtype=torch.int64)
        mask = torch.zeros(batch_size, width, dtype=torch.int64)
        for i, r in enumerate(rows):
            ids[i, : len(r)] = torch.tensor(r)
            mask[i, : len(r)] = 1
        labels = ids.masked_fill(mask == 0, -100)
        batches.append({"input_ids": ids, "attention_mask": mask, "labels": labels})
    return batches


@dataclass
class Reference:
    losses: list[float] = field(default_factory=list)
    grad_norms: list[float] = field(default_factory=list)
    aux_losses: list[float] = field(default_factory=list)  # MoE: the load-balancing loss
    params: dict[str, torch.Tensor] = field(default_factory=dict)


def reference_train(
    model_dir: Path, data: Path, train: dict[str, Any], frozen: tuple[str, ...] = ()
) -> Reference:
    """``frozen``: parameters set to ``requires_grad=False`` (AdamW and clipping over the
    others only, as a PyTorch user freezes them)."""
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).train()
    for name, p in model.named_parameters():
        if name in frozen:
            p.requires_grad_(False)
    patterns = [r"bias", r"layernorm", r"rmsnorm", r"(?:^|\.)norm(?:$|\.)", r"_norm(?:$|\.)"]
    decay = set(get_parameter_names(model, [nn.LayerNorm], patterns))  # type: ignore[no-untyped-call]
    named = [(n, p) for n, p in model.named_parameters() if p.requires_grad]  # tied: once
    decay &= {n for n, _ in named}  # HF lists the tied lm_head.weight too
    # HF's rule is the 1-D rule here but for Qwen3.5's A_log and Gemma 4's router scales, 1-D
    # tensors HF's names would decay and slidedp (1-D tensors never decay) does not: the
    # reference takes slidedp's rule there
    one_d_rule = {n for n, p in named if p.ndim >= 2}
    assert one_d_rule <= decay
    one_d_scales = (".A_log", ".router.scale", ".router.per_expert_scale")  # Gemma 4's router
    assert all(n.endswith(one_d_scales) for n in decay - one_d_rule), decay - one_d_rule
    decay = one_d_rule
    groups = [
        {"params": [p for n, p in named if n in decay], "weight_decay": train["weight_decay"]},
        {"params": [p for n, p in named if n not in decay], "weight_decay": 0.0},
    ]
    opt = torch.optim.AdamW(
        groups,
        lr=train["learning_rate"],
        betas=(train.get("adam_beta1", 0.9), train.get("adam_beta2", 0.999)),
        eps=train.get("adam_epsilon", 1e-8),
    )
    sched = get_scheduler(
        train["lr_scheduler"],
        opt,
        num_warmup_steps=train["warmup_steps"],
        num_training_steps=train["max_steps"],
    )
    ref = Reference()
    for batch in reference_batches(data, train["global_batch_size"], train["max_steps"]):
        out = model(**batch)
        loss = out.loss  # with router_aux_loss_coef * aux_loss added where the config says
        loss.backward()
        if getattr(out, "aux_loss", None) is not None:
            ref.aux_losses.append(float(out.aux_loss.detach()))
        max_norm = train["max_grad_norm"] or float("inf")  # HF Trainer skips clipping at 0
        norm = torch.nn.utils.clip_grad_norm_([p for _, p in named], max_norm)
        opt.step()
        sched.step()
        opt.zero_grad()
        ref.losses.append(float(loss.detach()))
        ref.grad_norms.append(float(norm))
    ref.params = {n: p.detach().clone() for n, p in model.state_dict().items()}
    return ref


def saved_tensors(path: Path) -> dict[str, torch.Tensor]:
    """Every tensor of every safetensors file under ``path``, by file and name."""
    out = {}
    for f in sorted(path.rglob("*.safetensors")):
        for name, t in load_file(f).items():
            out[f"{f.relative_to(path)}:{name}"] = t
    return out


def assert_bitwise_equal(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> None:
    """The same names, and every tensor the same bits (compared as 32-bit words)."""
    assert a.keys() == b.keys()
    for name in a:
        assert torch.equal(a[name].view(torch.int32), b[name].view(torch.int32)), name
