"""The config schema: strict keys and types, suggestions, every problem at once, resolved output."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

import pytest
import yaml

from slidedp.config import (
    RESOLVED_CONFIG,
    config_from_dict,
    config_to_dict,
    load_config,
    resolved_yaml,
    write_resolved_config,
)
from slidedp.config_runtime import RUNTIME_GROUP_OF, RuntimeSection
from slidedp.errors import ConfigError, require
from slidedp.schema import TextValue, build_section


def _raw(**sections: dict[str, Any]) -> dict[str, Any]:
    raw: dict[str, Any] = {
        "model": {"path": "m"},
        "data": {"path": "d.jsonl"},
        "train": {"max_steps": 3},
        "output": {"dir": "out"},
    }
    for name, values in sections.items():
        raw.setdefault(name, {}).update(values)
    return raw


def _yaml(tmp_path: Path, raw: dict[str, Any]) -> Path:
    path = tmp_path / "c.yaml"
    path.write_text(yaml.safe_dump(raw))
    return path


def _problems(raw: dict[str, Any]) -> list[str]:
    with pytest.raises(ConfigError) as info:
        config_from_dict(raw)
    assert str(info.value) == "\n".join(info.value.problems)
    return info.value.problems


def test_every_problem_of_file_and_overrides_is_reported_at_once(tmp_path: Path) -> None:
    raw = _raw(
        train={"max_stpes": 3, "learning_rate": "fast", "lr_scheduler": "cosin"},
        runtime={"slots": 0},
    )
    raw["trian"] = {}
    del raw["output"]
    overrides = ["runtime.offload_ratio=1.5", "outptu.dir=x", "data.seq_len=two",
                 "runtime.layers=3xF, 2xQ"]  # fmt: skip
    with pytest.raises(ConfigError) as info:
        load_config(_yaml(tmp_path, raw), overrides)
    assert sorted(info.value.problems) == sorted(
        [
            "unknown section 'outptu' in override 'outptu.dir=x' (did you mean 'output'?)",
            "unknown section 'trian' (did you mean 'train'?)",
            "missing section 'output' (required: add 'output:' with its keys)",
            "data.seq_len must be an integer, got 'two'",
            "unknown key 'train.max_stpes' (did you mean 'train.max_steps'?)",
            "train.learning_rate must be a finite number, got 'fast'",
            "train.lr_scheduler must be one of 'constant', 'linear', 'cosine', got 'cosin' "
            "(did you mean 'cosine'?)",
            "runtime.slots must be >= 1, got 0",
            "runtime.offload_ratio must be in [0, 1], got 1.5",
            "runtime.layers: cannot read layout entry '2xQ': expected [COUNTx]FAMILY[-rRATIO], "
            "FAMILY one of F, N, S<7 bits>, SAC.<preset> (e.g. '31xF-r0', 'S1010100-r0.5')",
        ]
    )


def test_value_checks_of_one_section_are_all_reported() -> None:
    train = {"max_steps": 0, "adam_beta1": 1.5, "adam_epsilon": 0, "seed": -1}
    assert _problems(_raw(train=train)) == [
        "train.max_steps must be >= 1, got 0",
        "train.adam_beta1 must be in [0, 1), got 1.5",
        "train.adam_epsilon must be > 0",
        "train.seed must be in [0, 2**63), got -1",  # numpy's generators refuse it mid-run
    ]
    overflow = _problems(_raw(train={"max_steps": 1, "learning_rate": 1e38, "adam_beta1": 0.9}))
    assert overflow == [  # 1e38 / (1 - 0.9) overflows f32: the update thread's error at step 1
        "train.learning_rate=1e+38 overflows AdamW's f32 step (learning_rate / (1 - adam_beta1) "
        "and learning_rate * weight_decay must stay under 3.4e38)"
    ]


@pytest.mark.parametrize(
    ("section", "key", "value", "expected"),
    [
        ("train", "max_steps", "3", "an integer"),
        ("train", "max_steps", 2.5, "an integer"),
        ("train", "max_steps", True, "an integer"),
        ("train", "learning_rate", [1e-4], "a finite number"),
        ("output", "export", "yes", "true or false"),
        ("output", "export", 1, "true or false"),
        ("model", "path", 7, "a string"),
        ("runtime", "device", "gpu", "one of 'auto', 'cpu', 'cuda'"),
    ],
)
def test_a_wrong_type_names_the_expected_type(
    section: str, key: str, value: object, expected: str
) -> None:
    (problem,) = _problems(_raw(**{section: {key: value}}))
    assert problem.startswith(f"{section}.{key} must be {expected}, got {value!r}")


def test_numbers_widen_only_where_no_information_is_lost() -> None:
    cfg = config_from_dict(_raw(train={"max_steps": 4.0, "learning_rate": 1, "weight_decay": 0}))
    assert (cfg.train.max_steps, cfg.train.learning_rate) == (4, 1.0)
    assert type(cfg.train.max_steps) is int
    assert type(cfg.train.learning_rate) is float


def test_exponent_floats_without_a_dot_are_numbers_in_the_file(tmp_path: Path) -> None:
    path = tmp_path / "c.yaml"
    path.write_text(yaml.safe_dump(_raw()))
    text = path.read_text().replace("max_steps: 3", "max_steps: 3\n  learning_rate: 1e-4")
    path.write_text(text)  # PyYAML alone reads 1e-4 as the string '1e-4'
    assert load_config(path).train.learning_rate == 1e-4


def test_overrides_are_yaml_values_or_text_where_the_key_takes_a_string(tmp_path: Path) -> None:
    path = _yaml(tmp_path, _raw())
    cfg = load_config(
        path,
        [
            "train.max_steps=7",
            "train.learning_rate=1e-4",
            "output.export=false",
            "data.path=123",  # a string key: the text, not the int
            "train.resume=",  # empty text, not YAML's null
            "model.path=/a/b: c",  # ': ' would be a YAML mapping
        ],
    )
    assert (cfg.train.max_steps, cfg.train.learning_rate, cfg.output.export) == (7, 1e-4, False)
    assert (cfg.data.path, cfg.train.resume, cfg.model.path) == ("123", "", "/a/b: c")


def test_a_path_starting_with_a_tilde_is_under_home_as_in_a_shell(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """``output.dir=~/runs/a`` passed validate and train made a directory named '~' in the
    current one; every path key now expands it (a quoted ~ in a shell reaches us as is)."""
    monkeypatch.setenv("HOME", str(tmp_path))
    path = _yaml(tmp_path, _raw())
    overrides = ["model.path=~/m", "output.dir=~/runs/a", "data.path=~/d.jsonl",
                 "data.eval_path=~/e.jsonl", "train.resume=~/runs/a/checkpoint-2"]  # fmt: skip
    cfg = load_config(path, overrides)
    home = str(tmp_path)
    assert cfg.train.resume == f"{home}/runs/a/checkpoint-2"
    assert load_config(path, ["train.resume=auto"]).train.resume == "auto"
    assert (cfg.model.path, cfg.output.dir) == (f"{home}/m", f"{home}/runs/a")
    assert (cfg.data.path, cfg.data.eval_path) == (f"{home}/d.jsonl", f"{home}/e.jsonl")
    mixed = load_config(path, ["data.path=", "data.sources=[{path: ~/a.jsonl}, {path: b.jsonl}]"])
    assert [s["path"] for s in mixed.data.sources] == [f"{home}/a.jsonl", "b.jsonl"]


def test_malformed_overrides_say_how_an_override_looks(tmp_path: Path) -> None:
    with pytest.raises(ConfigError) as info:
        load_config(_yaml(tmp_path, _raw()), ["max_steps=3", "train.max_steps", "a.b.c=1"])
    assert info.value.problems == [
        f"override '{o}' must look like section.key=value (e.g. train.max_steps=5)"
        for o in ("max_steps=3", "train.max_steps", "a.b.c=1")
    ]


@pytest.mark.parametrize(
    "override",
    [
        "train.learning_rate=.nan",
        "train.adam_epsilon=.inf",
        "train.weight_decay=1e999",
        "train.max_grad_norm=-.inf",
        "runtime.version_timeout_s=.inf",
    ],
)
def test_a_value_that_is_not_finite_is_a_config_error_naming_key_and_value(
    tmp_path: Path, override: str
) -> None:
    key, value = override.split("=")
    with pytest.raises(ConfigError) as info:
        load_config(_yaml(tmp_path, _raw()), [override])
    assert info.value.problems == [f"{key} must be a finite number, got '{value}'"]


def test_a_key_given_twice_in_the_file_is_an_error(tmp_path: Path) -> None:
    path = tmp_path / "c.yaml"
    path.write_text("train:\n  max_steps: 3\n  max_steps: 4\n")
    with pytest.raises(ConfigError, match=r"at line 3: duplicate key 'max_steps'"):
        load_config(path)


def test_unreadable_garbled_and_non_mapping_files(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match=r"cannot read config .*No such file.*check the path"):
        load_config(tmp_path / "missing.yaml")
    path = tmp_path / "c.yaml"
    path.write_text("train: [1, 2\n")
    with pytest.raises(
        ConfigError, match=r"is not valid YAML at line 2: .* \(fix the file there\)"
    ):
        load_config(path)
    path.write_text("- model\n- data\n")
    with pytest.raises(ConfigError, match=r"must be a mapping of sections .* got list"):
        load_config(path)
    path.write_text("")
    with pytest.raises(ConfigError) as info:
        load_config(path)
    assert len(info.value.problems) == 4  # model, data, train, output missing
    path.write_text(yaml.safe_dump(_raw() | {"train": [1, 2]}))
    with pytest.raises(ConfigError, match=r"section 'train' must be a mapping of keys"):
        load_config(path)
    path.write_bytes(b"\x89PNG\r\n\x1a\n\x00\x00\x00\rIHDR\xff\xfe")  # not a text file
    with pytest.raises(ConfigError, match=r"config .*c.yaml is not a text file .*give the YAML"):
        load_config(path)


def test_resolved_config_has_every_key_and_loads_back_equal(tmp_path: Path) -> None:
    cfg = config_from_dict(_raw(output={"dir": str(tmp_path / "run")}))
    tree = config_to_dict(cfg)
    assert tree["train"]["learning_rate"] == 5e-5  # a default, filled in
    assert set(tree["runtime"]) >= {"slots", "offload_ratio", "device"}
    assert config_from_dict(tree) == cfg
    assert config_from_dict(yaml.safe_load(resolved_yaml(cfg))) == cfg
    written = write_resolved_config(cfg)
    assert written == tmp_path / "run" / RESOLVED_CONFIG
    assert config_from_dict(yaml.safe_load(written.read_text())) == cfg
    assert sorted(p.name for p in written.parent.iterdir()) == [RESOLVED_CONFIG]  # no temp left


def test_runtime_keys_stay_flat_in_yaml_and_land_in_their_groups(tmp_path: Path) -> None:
    overrides = ["runtime.gpus=2", "runtime.device=cuda", "runtime.trace_path=/t.json"]
    cfg = load_config(_yaml(tmp_path, _raw(runtime={"layers": "N", "policy": "fixed"})), overrides)
    rt = cfg.runtime
    assert (rt.launch.gpus, rt.launch.device, rt.launch.world) == (2, "cuda", 2)
    assert (rt.layout.layers, rt.autopolicy.policy, rt.trace.trace_path) == (
        "N",
        "fixed",
        "/t.json",
    )
    flat = config_to_dict(cfg)["runtime"]  # resolved_config.yaml and checkpoints: flat keys
    assert set(flat) == set(RUNTIME_GROUP_OF)
    assert (flat["gpus"], flat["layers"]) == (2, "N")
    assert not any(isinstance(v, dict) for v in flat.values())
    assert RuntimeSection.from_keys(**flat) == rt
    assert rt.with_keys(gpus=1, layers="F") == RuntimeSection.from_keys(
        **flat | {"gpus": 1, "layers": "F"}
    )
    (problem,) = _problems(_raw(runtime={"launch": {"gpus": 2}}))  # groups are no YAML keys
    assert problem.startswith("unknown key 'runtime.launch' (valid: bf16_mirror, ")
    with pytest.raises(TypeError, match="no keys"):
        rt.with_keys(gpu=2)


@dataclass(kw_only=True)
class _Section:
    names: list[str] = field(default_factory=list)
    limits: dict[str, int] = field(default_factory=dict)
    label: str | None = None
    mode: Literal["a", "b"] = "a"
    low: int = 0
    high: int = 1

    def __post_init__(self) -> None:
        require(self.low >= 0, "s.low must be >= 0")
        require(self.high > self.low, "s.high must be > s.low")
        require(10 // (self.high - self.low) >= 0, "unreachable")  # trips if high == low


def test_schema_containers_optionals_and_collected_checks() -> None:
    problems: list[str] = []
    ok = {"names": ["x"], "limits": {"k": 2}, "label": None, "mode": "b"}
    assert build_section("s", _Section, ok, problems) == _Section(
        names=["x"], limits={"k": 2}, label=None, mode="b"
    )
    assert problems == []
    bad = {"names": ["x", 1], "limits": {"k": "2"}, "label": 3, "mode": "c"}
    assert build_section("s", _Section, bad, problems) is None
    assert problems == [
        "s.names must be a list whose items are each a string, got ['x', 1]",
        "s.limits must be a mapping from a string to an integer, got {'k': '2'}",
        "s.label must be a string or null, got 3",
        "s.mode must be one of 'a', 'b', got 'c'",
    ]
    problems.clear()
    # both failed checks are reported; the crash of a third check that depends on them is not
    assert build_section("s", _Section, {"low": -1, "high": -1}, problems) is None
    assert problems == ["s.low must be >= 0", "s.high must be > s.low"]


def test_a_list_key_given_one_word_on_the_command_line_shows_the_list_form() -> None:
    problems: list[str] = []
    assert build_section("s", _Section, {"names": TextValue("layers.0")}, problems) is None
    assert problems == [
        "s.names must be a list whose items are each a string, got 'layers.0' (a list on the "
        "command line: s.names='[layers.0]')"
    ]


def test_an_unsupported_annotation_is_a_programming_error() -> None:
    @dataclass(kw_only=True)
    class WithPath:
        where: Path = Path()

    with pytest.raises(TypeError, match=r"not supported by slidedp\.schema"):
        build_section("s", WithPath, {"where": "x"}, [])


EXAMPLES = Path(__file__).parents[2] / "examples"


@pytest.mark.parametrize(
    "example", sorted(EXAMPLES.glob("**/*.yaml")), ids=lambda p: str(p.relative_to(EXAMPLES))
)
def test_every_example_config_follows_the_schema(example: Path) -> None:
    cfg = load_config(example)
    assert config_from_dict(config_to_dict(cfg)) == cfg
