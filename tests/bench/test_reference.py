"""The compute-only reference: HF's loss with the same weights, timed steps on CPU."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM

from bench.tiny import tiny_config, tiny_spec
from slidedp.bench.reference import ReferenceModel, run_reference
from slidedp.errors import ConfigError
from slidedp.models.fast import Compute
from slidedp.models.hf import HFAdapter


@pytest.mark.parametrize("tied", [True, False])
def test_reference_loss_and_embedding_grad_are_the_hf_models(tied: bool) -> None:
    adapter = HFAdapter(tiny_config(tie_word_embeddings=tied))
    ref = ReferenceModel(adapter, torch.device("cpu"), torch.float32, chunk_tokens=16)
    model = AutoModelForCausalLM.from_config(adapter.config)  # type: ignore[no-untyped-call]
    missing, unexpected = model.load_state_dict(ref.weights, strict=False)
    assert not unexpected
    assert missing == (["lm_head.weight"] if tied else [])  # a tied head is the embedding
    ids = torch.randint(0, 256, (3, 20), generator=torch.Generator().manual_seed(0))
    expected = model(input_ids=ids, labels=ids).loss
    expected.backward()
    loss, grad_embed = ref.step(ids)
    assert loss == pytest.approx(float(expected.detach()), rel=1e-5)
    # the embedding gradient is where the whole backward (every layer, the head) ends up
    torch.testing.assert_close(grad_embed, model.model.embed_tokens.weight.grad)


@pytest.mark.e2e
def test_run_reference_times_the_measured_steps(tmp_path: Path) -> None:
    spec = tiny_spec(tmp_path, "reference", ["runtime.loss_chunk_tokens=8"])
    result = run_reference(spec)
    assert len(result["step_times_s"]) == 2  # the warm-up step is not reported
    assert all(t > 0 for t in result["step_times_s"])
    assert result["tokens_per_step"] == 32
    assert all(5.0 < loss < 6.0 for loss in result["losses"])  # about ln(256) = 5.55


@pytest.mark.e2e
def test_the_reference_with_compiled_layers_is_the_eager_reference() -> None:
    """``aot_eager``: the traced graph run by the eager kernels, so equal bit for bit (the
    engine's compiled layers: ``tests/engine/test_fast.py``)."""
    ids = torch.randint(0, 256, (3, 20), generator=torch.Generator().manual_seed(0))
    cpu = torch.device("cpu")
    eager = ReferenceModel(HFAdapter(tiny_config()), cpu, torch.float32, chunk_tokens=16)
    compiled = ReferenceModel(HFAdapter(tiny_config()), cpu, torch.float32, chunk_tokens=16,
                              compute=Compute("eager", "aot_eager"))  # fmt: skip
    torch._dynamo.reset()
    loss, grad = eager.step(ids)
    loss_c, grad_c = compiled.step(ids)
    assert loss_c == loss
    assert torch.equal(grad_c, grad)


def test_the_reference_reads_the_layer_compute_from_ours_policy_file(tmp_path: Path) -> None:
    policy = tmp_path / "policy.yaml"
    policy.write_text("layers: N\nkernels: liger\n")
    spec = tiny_spec(tmp_path, "reference", [f"runtime.policy={policy}"])
    with pytest.raises(ConfigError, match=r"runtime\.kernels=liger cannot run here"):
        run_reference(spec)  # on CPU: Liger is refused, as ours refuses it
    policy.write_text("layers: N\nkernels: eager\n")
    assert run_reference(spec)["kernels"].startswith("eager, not compiled")
