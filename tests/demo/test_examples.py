"""The ready configs under ``examples/`` stay valid as the config schema evolves, and the sample
chat data is well-formed ``messages`` records."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from slidedp.autopolicy.default import default_policy
from slidedp.config import load_config

EXAMPLES = Path(__file__).resolve().parents[2] / "examples"


@pytest.mark.parametrize(
    "path", sorted(EXAMPLES.rglob("*.yaml")), ids=lambda p: str(p.relative_to(EXAMPLES))
)
def test_example_config_loads(path: Path) -> None:
    cfg = load_config(path)
    assert cfg.train.max_steps >= 1


def test_expected_examples_exist() -> None:
    names = {str(p.relative_to(EXAMPLES)) for p in EXAMPLES.rglob("*.yaml")}
    assert names >= {
        "demo/train.yaml",
        "qwen3-4b-1gpu.yaml",
        "qwen3-8b-2gpu.yaml",
        "chat-sft.yaml",
        "tiny-qwen3.yaml",
    }


@pytest.mark.parametrize("name", ["qwen3-4b-1gpu.yaml", "qwen3-8b-2gpu.yaml", "chat-sft.yaml"])
def test_the_gpu_examples_name_no_layout_so_autopolicy_chooses_it(name: str) -> None:
    rule = default_policy(load_config(EXAMPLES / name).runtime, "cuda")  # as the README says
    assert rule.auto, rule.why


def test_chat_sample_is_messages_ending_with_the_assistant() -> None:
    cfg = load_config(EXAMPLES / "chat-sft.yaml")
    lines = (EXAMPLES.parent / cfg.data.path).read_text().splitlines()
    assert len(lines) >= cfg.train.global_batch_size
    for line in lines:
        messages = json.loads(line)["messages"]
        roles = [m["role"] for m in messages]
        assert set(roles) <= {"system", "user", "assistant"}
        assert roles[-1] == "assistant"
        assert all(isinstance(m["content"], str) and m["content"] for m in messages)
