"""``runtime.context_parallel`` refusals through the CLI: exit 2, one line naming the key and
the fix, nothing written; ``validate`` and ``train`` refuse alike (one preflight)."""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml

from cli.util import one_error_line, run, snapshot
from engine.tiny import make_model, write_config, write_data

Capsys = pytest.CaptureFixture[str]
VERBS = ("validate", "train")


@pytest.fixture(scope="module")
def model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A tiny untied Qwen3 (4 query, 2 key/value heads) with weights."""
    return make_model(tmp_path_factory.mktemp("models"), "qwen3", tied=False)


def _config(tmp_path: Path, model: Path, **sections: object) -> Path:
    data = write_data(tmp_path / "data.jsonl", 8)
    return write_config(tmp_path / "c.yaml", model, data, tmp_path / "out", **sections)


def _fails(capsys: Capsys, verb: str, config: Path, needles: tuple[str, ...]) -> None:
    """``slidedp VERB CONFIG``: exit 2, one error line with ``needles``, nothing written."""
    out_dir = Path(yaml.safe_load(config.read_text())["output"]["dir"])
    before = [snapshot(config.parent, itself=True), snapshot(out_dir, itself=True)]
    code, _, err = run(capsys, verb, str(config))
    assert code == 2, err
    assert [snapshot(config.parent, itself=True), snapshot(out_dir, itself=True)] == before
    one_error_line(err, verb, *needles)


# (runtime and other sections, needles of the one error line)
REFUSED = [
    ({"runtime": {"ranks": 3, "context_parallel": 2}}, ("does not divide the 3 ranks",)),
    ({"runtime": {"ranks": 3, "context_parallel": 3}}, ("data.seq_len=32 must divide",)),
    ({"runtime": {"ranks": 4, "context_parallel": 4, "context_attention": "ulysses"}},
     ("4 query and 2 key/value heads", "runtime.context_attention=allgather")),
    ({"runtime": {"ranks": 2, "context_parallel": 2, "compile": True}},
     ("runtime.compile=false",)),
    ({"runtime": {"ranks": 2, "context_parallel": 2, "kernels": "liger"}},
     ("runtime.kernels=eager",)),
    ({"runtime": {"ranks": 4, "context_parallel": 2},
      "train": {"global_batch_size": 3, "max_steps": 3, "learning_rate": 1e-3}},
     ("global_batch_size=3", "2 groups of runtime.context_parallel=2")),
]  # fmt: skip


@pytest.mark.parametrize("verb", VERBS)
@pytest.mark.parametrize(("sections", "needles"), REFUSED)
def test_context_parallel_refusals(
    capsys: Capsys,
    tmp_path: Path,
    model: Path,
    verb: str,
    sections: dict[str, dict[str, object]],
    needles: tuple[str, ...],
) -> None:
    runtime = {"device": "cpu"} | sections.get("runtime", {})
    config = _config(tmp_path, model, **(sections | {"runtime": runtime}))
    _fails(capsys, verb, config, needles)


@pytest.mark.parametrize("verb", VERBS)
def test_unchecked_model_type_is_refused(capsys: Capsys, tmp_path: Path, verb: str) -> None:
    """A model type no parity test covers (here a mixture of experts other than Qwen3-MoE)."""
    moe = make_model(tmp_path / "m", "mixtral", tied=False)
    config = _config(tmp_path, moe, runtime={"device": "cpu", "ranks": 2, "context_parallel": 2})
    _fails(capsys, verb, config, ("model type mixtral is not supported yet",
                                  "runtime.context_parallel=1"))  # fmt: skip


def test_zero_is_refused(capsys: Capsys, tmp_path: Path, model: Path) -> None:
    config = _config(tmp_path, model, runtime={"device": "cpu", "context_parallel": 0})
    _fails(capsys, "validate", config, ("runtime.context_parallel must be >= 1",))
