"""The layout text form, the policy file and the placement helper (``slidedp.plan``)."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
import torch

from engine.tiny import make_model, write_config, write_data
from slidedp.cli import main
from slidedp.config import load_config
from slidedp.errors import ConfigError
from slidedp.models.hf import HFAdapter
from slidedp.plan.layout import LayerPolicy, format_layout, parse_layout, place
from slidedp.plan.policy import Policy, resolve_policy

CPU = torch.device("cpu")


def test_a_layout_reads_counts_families_and_ratios_and_writes_back() -> None:
    layers = parse_layout("2xF-r1, 1xS1010100-r0.5, 1xSAC.mm, N", 6, default_ratio=0.25)
    assert layers == (
        LayerPolicy("F", ratio=1.0),
        LayerPolicy("F", ratio=1.0),
        LayerPolicy("S", "1010100", 0.5),
        LayerPolicy("SAC", "mm", 0.25),
        LayerPolicy("N", ratio=0.25),
        LayerPolicy("N", ratio=0.25),
    )
    text = format_layout(layers)
    assert text == "2xF-r1, 1xS1010100-r0.5, 1xSAC.mm-r0.25, 2xN-r0.25"
    assert parse_layout(text, 6, default_ratio=0.0) == layers


@pytest.mark.parametrize(
    ("text", "error"),
    [
        ("31xF, 9xN", "describes 40 layers, the model has 36"),
        ("3xF", "describes 3 layers, the model has 36 (add an entry without a count"),
        ("F, N", "at most one entry without a count"),
        ("S101", "cannot read layout entry 'S101'"),
        ("SAC.everything", "unknown SAC preset 'everything'"),
        ("F-r1.5", "offload ratio must be in [0, 1], got 1.5"),
        ("F-r1.2.3", "offload ratio '1.2.3' in 'F-r1.2.3' is not a number"),
        ("", "runtime.layers is empty"),
    ],
)
def test_a_bad_layout_is_one_config_error(text: str, error: str) -> None:
    with pytest.raises(ConfigError, match=re.escape(error)):
        parse_layout(text, 36, default_ratio=0.0)


def test_placement_puts_offloaded_layers_first_and_retained_ones_light_to_heavy() -> None:
    f1, f0 = LayerPolicy("F", ratio=1.0), LayerPolicy("F")
    n, s = LayerPolicy("N"), LayerPolicy("S", "1010100")
    layers = place([(n, 2), (f0, 1), (f1, 2), (s, 1)], {n: 300, f0: 10, f1: 10, s: 100})
    assert layers == (f1, f1, f0, s, n, n)


def test_a_policy_file_sets_the_layout_and_routes(tmp_path: Path) -> None:
    model = make_model(tmp_path, "qwen3", tied=True, layers=4)
    data = write_data(tmp_path / "data.jsonl", 8)
    policy_file = tmp_path / "policy.yaml"
    policy_file.write_text("layers: 3xF-r1, N\ngrad_slots: 3\n")
    config = write_config(tmp_path / "c.yaml", model, data, tmp_path / "out",
                          runtime={"policy": str(policy_file)})  # fmt: skip
    cfg = load_config(config)
    policy = resolve_policy(cfg.runtime, HFAdapter.from_dir(model), mirror=False, device=CPU)
    assert policy.layout == "3xF-r1, 1xN-r0"
    assert policy.grad_slots == 3
    assert Policy.from_dict(policy.to_dict()) == policy
    clash = load_config(config, ["runtime.grad_slots=5"])
    with pytest.raises(ConfigError, match="sets grad_slots, which the config sets differently"):
        resolve_policy(clash.runtime, HFAdapter.from_dir(model), mirror=False, device=CPU)
    policy_file.write_text("layers: 3xF\nslotz: 3\n")
    with pytest.raises(ConfigError, match=r"unknown keys \['slotz'\]"):
        resolve_policy(cfg.runtime, HFAdapter.from_dir(model), mirror=False, device=CPU)


@pytest.mark.e2e
def test_the_policy_is_in_the_banner_and_in_every_checkpoint(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    model = make_model(tmp_path, "qwen3", tied=True, layers=3)
    data = write_data(tmp_path / "data.jsonl", 8)
    out = tmp_path / "out"
    config = write_config(tmp_path / "c.yaml", model, data, out, train={"max_steps": 1},
                          runtime={"layers": "2xN, SAC.attn-r1"})  # fmt: skip
    assert main(["train", str(config)]) == 0
    banner = capsys.readouterr().out
    assert "policy: replicated/gpu" in banner
    assert "from the policy file" not in banner  # the config's own keys
    assert "layers 2xN-r0, 1xSAC.attn-r1" in banner
    state = (out / "checkpoint-1" / "trainer_state.json").read_text()
    assert '"layers": "2xN-r0, 1xSAC.attn-r1"' in state
    assert "layers: 2xN, SAC.attn-r1" in (out / "resolved_config.yaml").read_text()
