"""Every bad input through the CLI: exit code 2, ONE line naming the problem and the fix, no
traceback, nothing written into the output directory. Run in-process (``slidedp.cli.main``)."""

from __future__ import annotations

import json
import os
import resource
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import yaml
from safetensors.torch import load_file, save_file
from transformers import Qwen3Config

from cli.util import one_error_line, run, snapshot
from engine.tiny import make_model, write_config, write_data
from slidedp.config import load_config
from slidedp.errors import OutOfSharedMemoryError
from slidedp.runtime.trainer import Trainer

REPO = Path(__file__).resolve().parents[2]

Capsys = pytest.CaptureFixture[str]
VERBS = ("validate", "train")


@pytest.fixture(scope="module")
def model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A tiny untied Qwen3 with weights; tests that damage it work on a copy (``model_copy``)."""
    return make_model(tmp_path_factory.mktemp("models"), "qwen3", tied=False)


@pytest.fixture
def model_copy(model: Path, tmp_path: Path) -> Path:
    copy = tmp_path / "model"
    copy.mkdir()
    for f in model.iterdir():
        (copy / f.name).write_bytes(f.read_bytes())
    return copy


def _config(tmp_path: Path, model: Path, data: Path | None = None, **sections: object) -> Path:
    data = data or write_data(tmp_path / "data.jsonl", 8)
    return write_config(tmp_path / "c.yaml", model, data, tmp_path / "out", **sections)


def _fails(capsys: Capsys, verb: str, config: Path, *args: str, needles: tuple[str, ...]) -> str:
    """Run ``slidedp VERB CONFIG ARGS``: exit 2, one error line, nothing written in the test's
    directory (the config's, holding model copy, data and output dir) nor in the output dir."""
    out_dir = Path(yaml.safe_load(config.read_text())["output"]["dir"]) if config.exists() else None
    before = [snapshot(config.parent, itself=True)] + (
        [snapshot(out_dir, itself=True)] if out_dir else []
    )
    code, _, err = run(capsys, verb, str(config), *args)
    assert code == 2, err
    after = [snapshot(config.parent, itself=True)] + (
        [snapshot(out_dir, itself=True)] if out_dir else []
    )
    assert after == before
    return one_error_line(err, verb, *needles)


@pytest.mark.parametrize("verb", VERBS)
def test_missing_config_file(capsys: Capsys, tmp_path: Path, verb: str) -> None:
    _fails(capsys, verb, tmp_path / "nope.yaml", needles=("cannot read config", "check the path"))


def test_garbled_config(capsys: Capsys, tmp_path: Path, model: Path) -> None:
    config = _config(tmp_path, model)
    text = config.read_text()
    config.write_text(text.replace("model:", "model: [", 1))
    code, _, err = run(capsys, "train", str(config))
    assert code == 2
    one_error_line(err, "train", "is not valid YAML at line", "fix the file there")


def test_unknown_key_suggests_the_closest(capsys: Capsys, tmp_path: Path, model: Path) -> None:
    config = _config(tmp_path, model)
    _fails(
        capsys,
        "train",
        config,
        "train.max_stpes=3",
        needles=("unknown key 'train.max_stpes'", "did you mean 'train.max_steps'?"),
    )
    config.write_text(config.read_text() + "logging: {a: 1}\n")
    _fails(capsys, "validate", config, needles=("unknown section 'logging'", "valid: data, model"))


def test_wrong_type_names_the_expected_type(capsys: Capsys, tmp_path: Path, model: Path) -> None:
    config = _config(tmp_path, model)
    _fails(
        capsys,
        "train",
        config,
        "train.max_steps=many",
        needles=("train.max_steps must be an integer, got 'many'",),
    )


def test_several_problems_are_listed_under_one_header(
    capsys: Capsys, tmp_path: Path, model: Path
) -> None:
    config = _config(tmp_path, model)
    overrides = ["train.max_stpes=3", "train.learning_rate=fast", "runtime.slots=0"]
    code, _, err = run(capsys, "train", str(config), *overrides)
    assert code == 2
    assert "Traceback" not in err
    header, *problems = err.splitlines()
    assert header == "slidedp train: error: the config has 3 problems:"
    assert problems == [
        "  train.learning_rate must be a finite number, got 'fast'",  # the file's key order
        "  unknown key 'train.max_stpes' (did you mean 'train.max_steps'?)",
        "  runtime.slots must be >= 1, got 0",
    ]
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize("verb", VERBS)
def test_missing_model_dir(capsys: Capsys, tmp_path: Path, verb: str) -> None:
    config = _config(tmp_path, tmp_path / "no-such-model")
    _fails(capsys, verb, config, needles=("model.path", "does not exist", "set model.path"))


def test_model_dir_without_config_json(capsys: Capsys, tmp_path: Path, model_copy: Path) -> None:
    (model_copy / "config.json").unlink()
    config = _config(tmp_path, model_copy)
    _fails(capsys, "validate", config, needles=("has no config.json", "HF model directory"))


@pytest.mark.parametrize("verb", VERBS)
def test_missing_weights(capsys: Capsys, tmp_path: Path, model_copy: Path, verb: str) -> None:
    weights = load_file(model_copy / "model.safetensors")
    del weights["model.layers.1.mlp.up_proj.weight"]
    save_file(weights, model_copy / "model.safetensors", metadata={"format": "pt"})
    config = _config(tmp_path, model_copy)
    _fails(
        capsys,
        verb,
        config,
        needles=("weights missing", "model.layers.1.mlp.up_proj.weight", "re-download"),
    )


def test_missing_shard_of_an_index(capsys: Capsys, tmp_path: Path, model_copy: Path) -> None:
    (model_copy / "model.safetensors").rename(model_copy / "model-00001-of-00002.safetensors")
    index = {"weight_map": {"a": "model-00001-of-00002.safetensors", "b": "model-00002.st"}}
    (model_copy / "model.safetensors.index.json").write_text(json.dumps(index))
    config = _config(tmp_path, model_copy)
    _fails(capsys, "train", config, needles=("model-00002.st", "re-download the model"))


def test_mismatched_weight_shapes(capsys: Capsys, tmp_path: Path, model_copy: Path) -> None:
    weights = load_file(model_copy / "model.safetensors")
    weights["model.norm.weight"] = torch.ones(65)
    save_file(weights, model_copy / "model.safetensors", metadata={"format": "pt"})
    config = _config(tmp_path, model_copy)
    _fails(capsys, "validate", config, needles=("'model.norm.weight' has shape (65,)", "(64,)"))


@pytest.mark.parametrize("verb", VERBS)
@pytest.mark.parametrize(
    ("field", "value"),
    [("num_hidden_layers", "two"), ("hidden_size", 64.5), ("vocab_size", None), ("head_dim", -1)],
)
def test_model_config_field_of_the_wrong_type_or_value(
    capsys: Capsys, tmp_path: Path, model_copy: Path, verb: str, field: str, value: object
) -> None:
    config_json = model_copy / "config.json"
    config_json.write_text(json.dumps(json.loads(config_json.read_text()) | {field: value}))
    config = _config(tmp_path, model_copy)
    _fails(capsys, verb, config, needles=(f"{config_json}", f"'{field}'", "fix the f"))


@pytest.mark.parametrize("verb", VERBS)
@pytest.mark.parametrize(
    ("fields", "needle"),
    [
        ({"num_key_value_heads": 3}, "'num_attention_heads' 4 is not a multiple of"),
        ({"num_hidden_layers": 10**12}, "'num_hidden_layers' is 1,000,000,000,000, more than"),
    ],
)
def test_model_config_sizes_that_build_no_model(
    capsys: Capsys, tmp_path: Path, model: Path, verb: str, fields: dict[str, int], needle: str
) -> None:
    """Refused before a layer is built, for a config-only model too: 10**12 layers ran for
    ever; heads in no whole key/value groups passed validate and failed train's first step."""
    config_only = tmp_path / "config-only"
    config_only.mkdir()
    values = json.loads((model / "config.json").read_text())
    values.pop("layer_types", None)  # else transformers refuses a list of another length first
    (config_only / "config.json").write_text(json.dumps(values | fields))
    config = _config(tmp_path, config_only)
    _fails(capsys, verb, config, needles=(f"{config_only}/config.json", needle, "fix the field"))


def test_a_heads_refusal_says_when_the_kv_heads_are_transformers_default(
    capsys: Capsys, tmp_path: Path, model: Path
) -> None:
    config_only = tmp_path / "config-only"
    config_only.mkdir()
    values = json.loads((model / "config.json").read_text())
    del values["num_key_value_heads"]  # Qwen3Config's default: 32, for the model's 4 heads
    (config_only / "config.json").write_text(json.dumps(values))
    default = "'num_key_value_heads' 32 (transformers' default: the file does not set it)"
    _fails(capsys, "validate", _config(tmp_path, config_only), needles=(default,))


@pytest.mark.parametrize("verb", VERBS)
@pytest.mark.parametrize("model_type", ["gpt2", "bogus_arch"])  # known to transformers, or not
def test_unsupported_architecture(
    capsys: Capsys, tmp_path: Path, verb: str, model_type: str
) -> None:
    model = tmp_path / model_type
    model.mkdir()
    (model / "config.json").write_text(json.dumps({"model_type": model_type, "n_layer": 2}))
    config = _config(tmp_path, model)
    line = _fails(capsys, verb, config,
                  needles=(f"model type '{model_type}' is not supported", "qwen3"))  # fmt: skip
    assert "transformers" not in line  # not its advice to upgrade it


@pytest.mark.parametrize("verb", VERBS)
def test_corrupt_safetensors(capsys: Capsys, tmp_path: Path, model_copy: Path, verb: str) -> None:
    weights = model_copy / "model.safetensors"
    os.truncate(weights, weights.stat().st_size - 1000)  # a download cut short
    config = _config(tmp_path, model_copy)
    _fails(capsys, verb, config, needles=("corrupt safetensors file", "re-download or re-export"))


def test_garbled_safetensors_header(capsys: Capsys, tmp_path: Path, model_copy: Path) -> None:
    (model_copy / "model.safetensors").write_bytes(
        b"\x10\x00\x00\x00\x00\x00\x00\x00{not json}    "
    )
    config = _config(tmp_path, model_copy)
    _fails(capsys, "validate", config, needles=("corrupt safetensors file",))


@pytest.mark.parametrize("verb", VERBS)
def test_bad_jsonl_line_names_file_and_line(
    capsys: Capsys, tmp_path: Path, model: Path, verb: str
) -> None:
    data = write_data(tmp_path / "data.jsonl", 4)
    lines = data.read_text().splitlines()
    lines[2] = '{"input_ids": [1, 2,'
    data.write_text("\n".join(lines) + "\n")
    config = _config(tmp_path, model, data)
    _fails(capsys, verb, config, needles=(f"{data}:3",))


@pytest.mark.parametrize("verb", VERBS)
def test_text_data_with_a_model_without_tokenizer_files(
    capsys: Capsys, tmp_path: Path, model: Path, verb: str
) -> None:
    assert not (model / "tokenizer.json").exists()
    data = tmp_path / "text.jsonl"
    data.write_text(
        "".join(json.dumps({"text": f"sample {i} of plain text"}) + "\n" for i in range(8))
    )
    config = _config(tmp_path, model, data)
    _fails(capsys, verb, config, needles=(f"{model} has no tokenizer files", "copy them"))


@pytest.mark.parametrize("verb", VERBS)
def test_empty_dataset(capsys: Capsys, tmp_path: Path, model: Path, verb: str) -> None:
    data = tmp_path / "empty.jsonl"
    data.write_text("")
    config = _config(tmp_path, model, data)
    _fails(capsys, verb, config, needles=(str(data),))


def _huge_model(root: Path) -> Path:
    """A config-only model (built on the meta device: nothing allocated) larger than any host."""
    model = root / "huge"
    Qwen3Config(
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        vocab_size=2**40,  # 2**46 embedding parameters: 12 bytes each is ~800 TB
    ).save_pretrained(model)
    return model


@pytest.mark.parametrize("verb", VERBS)
def test_too_little_shm_or_ram(capsys: Capsys, tmp_path: Path, verb: str) -> None:
    config = _config(tmp_path, _huge_model(tmp_path))
    _fails(capsys, verb, config, needles=("not enough space in", "GiB needed", "enlarge it"))


def test_a_run_that_fits_under_a_ulimit_v_is_not_refused(tmp_path: Path, model: Path) -> None:
    """The address-space check compares what a rank maps beyond the probing process's own
    mapping (the store): a limit a run fits under passes (it counted every rank's memory)."""
    config = _config(tmp_path, model)
    code = "import slidedp.cli; print(open('/proc/self/status').read())"
    status = subprocess.run([sys.executable, "-c", code], capture_output=True, check=True)
    fields = status.stdout.split()
    mapped = int(fields[fields.index(b"VmSize:") + 1]) * 1024  # after torch's import
    limit = mapped + 2**29  # the store of this model is a few MB (ranks' memory was 0.7 GiB)

    def limited() -> None:
        resource.setrlimit(resource.RLIMIT_AS, (limit, limit))

    command = [sys.executable, "-m", "slidedp", "validate", str(config)]
    done = subprocess.run(command, capture_output=True, text=True, preexec_fn=limited, timeout=300)
    assert done.returncode == 0, done.stderr


def test_a_ulimit_v_too_small_for_torch_itself_is_one_line(tmp_path: Path, model: Path) -> None:
    """Under 1 GiB of address space torch's libraries cannot be mapped: the import of the CLI
    fails before any check can run, and says so in one line (was the import's traceback)."""

    def limited() -> None:
        resource.setrlimit(resource.RLIMIT_AS, (2**30, 2**30))

    command = [sys.executable, "-m", "slidedp", "validate", str(_config(tmp_path, model))]
    done = subprocess.run(command, capture_output=True, text=True, preexec_fn=limited, timeout=300)
    assert done.returncode == 2
    assert done.stderr.count("\n") == 1, done.stderr
    assert done.stderr.startswith("slidedp: error: loading torch's libraries failed (")
    assert "(ulimit -v 1048576 KiB) is too small: raise it (ulimit -v unlimited)" in done.stderr


def test_the_command_s_entry_leaves_slidedp_main_to_the_ranks_runpy() -> None:
    """The ``slidedp`` script imports ``slidedp.entry``: a zygote, a copy of that process,
    runs ``slidedp.__main__`` for each rank, which runpy warns about if it was imported."""
    assert '\nslidedp = "slidedp.entry:main"\n' in (REPO / "pyproject.toml").read_text()
    code = "import sys, slidedp.entry; print('slidedp.__main__' in sys.modules)"
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert done.stdout.strip() == "False"


def test_the_host_store_itself_refuses_before_allocating(tmp_path: Path) -> None:
    """Past the CLI's lower-bound check, the store's own (exact) check, as the trainer meets it."""
    config = _config(tmp_path, _huge_model(tmp_path))
    with pytest.raises(OutOfSharedMemoryError, match="enlarge it") as info:
        Trainer(load_config(config))
    assert info.value.needed_bytes > info.value.available_bytes
    assert not (tmp_path / "out").exists()


@pytest.mark.skipif(torch.cuda.is_available(), reason="needs a machine without CUDA")
@pytest.mark.parametrize("verb", VERBS)
def test_cuda_asked_on_a_machine_without_it(
    capsys: Capsys, tmp_path: Path, model: Path, verb: str
) -> None:
    config = _config(tmp_path, model, runtime={"device": "cuda"})
    _fails(capsys, verb, config, needles=("no CUDA device", "set runtime.device=cpu"))


@pytest.mark.parametrize("verb", VERBS)
def test_output_dir_under_a_file(capsys: Capsys, tmp_path: Path, model: Path, verb: str) -> None:
    blocker = tmp_path / "a-file"
    blocker.write_text("x")
    config = _config(tmp_path, model, output={"dir": str(blocker / "out")})
    _fails(capsys, verb, config, needles=("cannot be created", "is a file", "another path"))
    assert blocker.read_text() == "x"


def _unwritable_dir(tmp_path: Path) -> Path:
    """A directory this process cannot write: read-only by mode, or /sys for root."""
    locked = tmp_path / "locked"
    locked.mkdir(mode=0o555)
    if not os.access(locked, os.W_OK):
        return locked
    if os.path.isdir("/sys") and not os.access("/sys", os.W_OK | os.X_OK):
        return Path("/sys")
    probe = Path("/sys/.slidedp-write-test")
    try:
        probe.write_text("")
    except OSError:
        return Path("/sys")  # read-only file system: root cannot write either
    probe.unlink()
    pytest.skip("no directory here is read-only for this user")


@pytest.mark.parametrize("verb", VERBS)
def test_output_dir_not_writable(capsys: Capsys, tmp_path: Path, model: Path, verb: str) -> None:
    parent = _unwritable_dir(tmp_path)
    config = _config(tmp_path, model, output={"dir": str(parent / "slidedp-run")})
    _fails(capsys, verb, config, needles=("is not writable", "choose a writable output.dir"))
    assert not (parent / "slidedp-run").exists()


@pytest.mark.parametrize("verb", VERBS)
def test_nothing_is_written_into_a_checkpoint_dir(
    capsys: Capsys, tmp_path: Path, model: Path, model_copy: Path, verb: str
) -> None:
    config = _config(tmp_path, model, output={"dir": str(model_copy)})
    _fails(capsys, verb, config, needles=("is a model or checkpoint directory", "new output.dir"))
