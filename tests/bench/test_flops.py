"""Model FLOPs per token against a hand count, and the GEMM peak measurement."""

from __future__ import annotations

import pytest
import torch
from transformers import MistralConfig

from bench.tiny import TINY, tiny_config
from slidedp.errors import InvalidArgumentError
from slidedp.runtime.flops import device_peak_flops, matmul_params, model_flops_per_token


def test_flops_per_token_is_the_hand_count() -> None:
    h, i, layers, v, s = 64, 128, 2, 256, 32
    q = o = h * 4 * 16  # 4 heads of 16
    k = vv = h * 2 * 16  # 2 kv heads of 16
    per_layer = q + k + vv + o + 3 * h * i  # attention projections + gate/up/down
    n_matmul = layers * per_layer + v * h  # + LM head; the embedding lookup is no matmul
    attention = 6 * layers * s * (4 * 16)  # causal half of 12 * L * S * d_attn
    assert matmul_params(tiny_config()) == n_matmul
    assert model_flops_per_token(tiny_config(), s) == 6 * n_matmul + attention


def test_the_head_counts_tied_or_not_and_the_embedding_never() -> None:
    tied = model_flops_per_token(tiny_config(tie_word_embeddings=True), 32)
    untied = model_flops_per_token(tiny_config(tie_word_embeddings=False), 32)
    assert tied == untied


def test_attention_term_uses_heads_times_head_dim() -> None:
    config = tiny_config(head_dim=32)  # d_attn 128 != hidden 64
    grow = model_flops_per_token(config, 64) - model_flops_per_token(config, 32)
    assert grow == 6 * TINY["num_hidden_layers"] * 32 * (4 * 32)


def test_sliding_window_layers_cap_the_attended_length() -> None:
    fields = {k: TINY[k] for k in TINY if k != "head_dim"}
    config = MistralConfig(**fields, head_dim=16, sliding_window=16)
    assert model_flops_per_token(config, 64) == model_flops_per_token(config, 16)
    assert model_flops_per_token(config, 8) < model_flops_per_token(config, 16)


def test_bad_seq_len_is_one_clear_error() -> None:
    with pytest.raises(InvalidArgumentError, match="seq_len must be >= 1"):
        model_flops_per_token(tiny_config(), 0)


def test_no_gemm_peak_on_cpu() -> None:
    assert device_peak_flops(torch.device("cpu")) is None


@pytest.mark.gpu
def test_gemm_peak_is_measured_once_and_plausible() -> None:
    peak = device_peak_flops(torch.device("cuda"))
    assert peak is not None
    assert 1e13 < peak < 1e16  # 10 TFLOP/s .. 10 PFLOP/s: any recent GPU, bf16 dense
    assert device_peak_flops(torch.device("cuda")) == peak  # cached per process


def test_layer_shapes_read_widths_params_and_the_attended_length() -> None:
    from slidedp.models.shape import layer_shapes

    h, i = 64, 128
    fields = {k: TINY[k] for k in TINY if k != "head_dim"}
    config = MistralConfig(**fields, head_dim=16, sliding_window=16)
    shapes = layer_shapes(config, 64)
    assert len(shapes) == TINY["num_hidden_layers"]
    s = shapes[0]
    assert (s.hidden, s.q_dim, s.kv_dim, s.attended) == (h, 4 * 16, 2 * 16, 16)
    matmul = h * 64 + 2 * h * 32 + 64 * h + 3 * h * i
    assert s.matmul_params == matmul
    assert s.params == s.active_params == matmul + 2 * h  # plus the two norms
    assert layer_shapes(config, 8)[0].attended == 8
