"""``runtime.policy: auto``'s selection cache (``selection_cache``): a second run of the same
key takes the choice from the cache and runs no profile, probe, solve nor trial; a changed
batch, sequence, clipping or model config selects again; a file that does not read is one line
and rewritten; ``runtime.policy_force`` selects again; a refused run caches nothing."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path
from typing import Any

import pytest
import yaml

from autopolicy.runs import resolve
from autopolicy.test_validate import ALL_F, CHOICE, GIB, FakeTrials, _config, _report
from engine.tiny import read_metrics
from host_profile.fake import cache_rate
from slidedp.autopolicy import choose, select, selection_cache, validate
from slidedp.autopolicy.command import report_path
from slidedp.cli import main
from slidedp.config import TrainConfig, load_config
from slidedp.models.hf import HFAdapter
from slidedp.plan import machine
from slidedp.plan.machine import Machine, update_threads
from slidedp.plan.resolve import resolve_plan
from slidedp.profile.cache import write_report
from slidedp.profile.layer import _profiled, cached_profile, profile_spec


def _profile_here(args: Any) -> dict[str, Any]:
    """``_report``'s rows cached as ``slidedp profile layer`` caches a measurement of ``args``."""
    prof = _profiled(args)
    for kind in prof.kinds:
        report = prof.facts | {"layer": kind, "candidates": _report()["candidates"], "cached": None}
        write_report(prof.cache(kind), report)
    found = cached_profile(args)
    assert found is not None
    return found


@pytest.fixture
def run(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> tuple[Path, Path, FakeTrials]:
    """A run with ``runtime.policy: auto`` (the program picks ``CHOICE``), its cache folder,
    and the trials it runs (the choice twice as fast as the default)."""
    cache = tmp_path / "cache"
    monkeypatch.setenv("XDG_CACHE_HOME", str(cache))
    path = _config(tmp_path, policy="auto")
    cfg = load_config(path, [])
    cache_rate(update_threads(cfg, Machine.probe(cfg, measure=False)), None, 1000.0)
    monkeypatch.setattr(choose, "profile_layer", _profile_here)
    trials = FakeTrials({"F": 1.0, "*": 0.5})
    monkeypatch.setattr(validate, "run_trial", trials)
    return path, cache / "slidedp" / "profile", trials


def _no_selection(monkeypatch: pytest.MonkeyPatch) -> None:
    """Any profile, host probe, solve or trial from here on fails the test."""

    def ran(*args: Any, **kwargs: Any) -> Any:
        raise AssertionError("a cached selection measured or solved")

    for module, name in [(choose, "profile_layer"), (machine, "probe_host"),
                         (select, "select_layout"), (validate, "run_trial")]:  # fmt: skip
        monkeypatch.setattr(module, name, ran)


@pytest.mark.e2e
def test_a_second_train_takes_the_cached_selection_and_trains_the_same_layout(
    run: tuple[Path, Path, FakeTrials],
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
) -> None:
    path, cache, trials = run
    assert main(["train", str(path)]) == 0
    first = next(x for x in capsys.readouterr().out.splitlines() if x.startswith("policy   auto: "))
    assert len(trials.ran) == 2  # the choice, the default
    (stored,) = cache.glob("selection-*.json")
    record = json.loads(stored.read_text())
    policy = record["plan"]["policy"]  # the chosen run's Plan.to_json
    assert (policy["layers"], policy["resident_layers"]) == (CHOICE, 0)
    assert record["validation"]["winner"] == "chosen"
    assert record["line"] == first
    assert set(record["timing_s"]) == {"profile", "host", "solve", "validation"}

    _no_selection(monkeypatch)
    again = f"output.dir={tmp_path / 'again'}"
    assert main(["train", str(path), again]) == 0
    out = capsys.readouterr().out
    (line,) = [x for x in out.splitlines() if x.startswith("policy   auto")]  # no stage lines
    assert line.startswith(f"{first}; from the cache {stored} (selected ")
    assert f" in {record['selection_s']:.1f} s; runtime.policy_force=true selects again)" in line
    for run_dir in (tmp_path / "out", tmp_path / "again"):
        resolved = yaml.safe_load((run_dir / "resolved_config.yaml").read_text())["runtime"]
        assert (resolved["layers"], resolved["resident_layers"]) == (CHOICE, 0)
    losses = [m["loss"] for m in read_metrics(tmp_path / "out")]
    assert losses == [m["loss"] for m in read_metrics(tmp_path / "again")]


def _edit_model_config(cfg: TrainConfig) -> None:
    config = Path(cfg.model.path) / "config.json"
    shape = json.loads(config.read_text())
    shape["rms_norm_eps"] = shape["rms_norm_eps"] * 10
    config.write_text(json.dumps(shape))


@pytest.mark.parametrize(
    "change",
    [
        "train.global_batch_size=8",
        "data.seq_len=16",
        "train.max_grad_norm=0",
        "train.freeze=[layers.0]",  # its updates are not there to place
        "config.json",
        "program",
    ],
)
def test_a_changed_term_selects_again(
    run: tuple[Path, Path, FakeTrials],
    change: str,
    capsys: pytest.CaptureFixture[str],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    path, cache, trials = run
    assert resolve(path)[0].runtime.layout.layers == CHOICE
    assert "from the cache" in resolve(path)[1]  # the same key: a hit, no trial
    assert len(trials.ran) == 2
    overrides = []
    if change == "config.json":
        _edit_model_config(load_config(path, []))
    elif change == "program":  # the program counts something new
        monkeypatch.setattr(
            selection_cache, "PROGRAM_REVISION", selection_cache.PROGRAM_REVISION + 1
        )
    else:
        overrides.append(change)
    line = resolve(path, *overrides)[1]
    assert "from the cache" not in line
    assert len(trials.ran) == 4  # selected again: the choice and the default ran
    assert len(list(cache.glob("selection-*.json"))) == 2  # the first one kept
    assert "from the cache" in resolve(path, *overrides)[1]
    assert "does not read" not in capsys.readouterr().out


def test_a_cache_file_that_does_not_read_is_one_line_and_rewritten(
    run: tuple[Path, Path, FakeTrials], capsys: pytest.CaptureFixture[str]
) -> None:
    path, cache, trials = run
    resolve(path)
    (stored,) = cache.glob("selection-*.json")
    record = json.loads(stored.read_text())
    older = {k: v for k, v in record.items() if k != "plan"} | {"layers": CHOICE}  # no plan
    for broken in ("{not json", json.dumps({"facts": {}, "layers": CHOICE}), json.dumps(older),
                   stored.read_text().replace(CHOICE, "9xN-r0")):  # fmt: skip
        stored.write_text(broken)
        capsys.readouterr()
        chosen, line = resolve(path)
        said = [x for x in capsys.readouterr().out.splitlines() if "does not read" in x]
        assert len(said) == 1
        assert said[0].startswith(f"policy   auto: the cached selection {stored} does not read (")
        assert said[0].endswith("): selecting again")
        assert "from the cache" not in line
        stored_policy = json.loads(stored.read_text())["plan"]["policy"]
        assert stored_policy["layers"] == chosen.runtime.layout.layers == CHOICE
    assert len(trials.ran) == 2 * 5


def test_policy_force_selects_again_and_caches_the_new_choice(
    run: tuple[Path, Path, FakeTrials], monkeypatch: pytest.MonkeyPatch
) -> None:
    path, cache, trials = run
    resolve(path)
    (stored,) = cache.glob("selection-*.json")
    # the default now runs faster: a forced selection keeps it, and the cache says so after
    monkeypatch.setattr(validate, "run_trial", FakeTrials({"F": 1.0, "*": 2.0}))
    chosen, line = resolve(path, "runtime.policy_force=true")
    assert "from the cache" not in line
    assert chosen.runtime.layout.layers == ALL_F
    assert json.loads(stored.read_text())["plan"]["policy"]["layers"] == ALL_F
    chosen, line = resolve(path)
    assert (chosen.runtime.layout.layers, "from the cache" in line) == (ALL_F, True)
    assert len(trials.ran) == 2  # the first selection's


def test_a_refused_run_writes_nothing_and_caches_nothing(
    run: tuple[Path, Path, FakeTrials],
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
) -> None:
    path, cache, _ = run
    monkeypatch.setattr(validate, "run_trial", FakeTrials({"*": None}))  # nothing fits
    assert main(["train", str(path)]) == 2
    assert "no layout fit the device in validation" in capsys.readouterr().err
    assert not (tmp_path / "out").exists()
    assert not list(cache.glob("selection-*.json"))
    # a setting auto refuses: refused before any measuring, nothing cached either
    assert main(["train", str(path), "runtime.layers=N"]) == 2
    assert not (tmp_path / "out").exists()
    assert not list(cache.glob("selection-*.json"))


@pytest.mark.e2e
def test_a_resumed_run_keeps_its_checkpoints_layout_over_the_cache(
    run: tuple[Path, Path, FakeTrials], tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    path, cache, _ = run
    assert main(["train", str(path), "output.save_steps=1"]) == 0
    (stored,) = cache.glob("selection-*.json")
    record = json.loads(stored.read_text())
    record["plan"]["policy"]["layers"] = ALL_F
    stored.write_text(json.dumps(record))  # the cache now says all F
    capsys.readouterr()
    assert main(["train", str(path), "train.max_steps=3", "train.resume=auto"]) == 0
    line = next(x for x in capsys.readouterr().out.splitlines() if x.startswith("policy   auto"))
    assert line.startswith(f"policy   auto: {CHOICE}, 0 GPU-resident (kept from checkpoint-2)")


def test_auto_takes_the_choice_slidedp_plan_made_for_the_same_run(
    run: tuple[Path, Path, FakeTrials], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A plan for this machine's GPU (its size faked here) from cached measurements is kept in
    the selection cache; ``auto`` of the same run then selects nothing."""

    path, cache, trials = run
    probe = Machine.probe

    def with_gpu(cfg: TrainConfig, *args: Any, **kwargs: Any) -> Machine:
        return dataclasses.replace(probe(cfg, *args, **kwargs), gpu_total_bytes=80 * GIB)

    monkeypatch.setattr(Machine, "probe", with_gpu)
    monkeypatch.setattr(choose, "profile_layer", _profile_here)
    policy = tmp_path / "plan.json"
    assert main(["plan", str(path), "--out", str(policy)]) == 0
    assert len(trials.ran) == 2
    (stored,) = cache.glob("selection-*.json")
    summary = json.loads(report_path(policy).read_text())
    measuring = [(choose, "profile_layer"), (machine, "probe_host"), (select, "select_layout"),
                 (validate, "run_trial")]  # fmt: skip
    kept = [getattr(module, name) for module, name in measuring]
    _no_selection(monkeypatch)
    chosen, line = resolve(path)
    assert (chosen.runtime.layout.layers, chosen.runtime.layout.resident_layers) == (
        summary["layout"],
        summary["resident_layers"],
    )
    assert line.startswith(f"policy   auto: {summary['layout']}, ")
    said = (
        "chunk the config's (on CPU no copy to cut); not calibrated "
        "(runtime.policy_calibrate_steps=0); validated (3 steps each): "
    )
    assert ", chosen by `slidedp plan`, host AdamW " in line
    assert f"; {said}" in line
    assert f"; from the cache {stored} (selected " in line
    # another GPU's plan (--gpu-memory) is not this machine's selection: nothing cached
    stored.unlink()
    for (module, name), was in zip(measuring, kept, strict=True):
        monkeypatch.setattr(module, name, was)
    assert main(["plan", str(path), "--out", str(policy), "--gpu-memory", "40"]) == 0
    assert not list(cache.glob("selection-*.json"))


def test_the_launchers_choice_on_several_ranks_is_cached_with_its_routes(
    run: tuple[Path, Path, FakeTrials], monkeypatch: pytest.MonkeyPatch
) -> None:
    """``runtime.ranks=2``: the launcher's choice, validated on the ranks, and the routes it
    keeps are cached; the next launch measures nothing (no child process) and runs no trial."""
    from slidedp.autopolicy import measure

    path, cache, trials = run
    ranks = ["runtime.ranks=2", "runtime.device=cpu"]

    def measured_here(cfg: TrainConfig) -> float:  # the child's measurements, cached
        _profile_here(profile_spec(cfg))
        threads = update_threads(cfg, Machine.probe(cfg, measure=False))
        cache_rate(threads, None, 1000.0, pools=(2, 500.0))  # two ranks' pools share it
        return 0.1

    monkeypatch.setattr(measure, "measure_in_child", measured_here)
    monkeypatch.setattr(validate, "trial_on_ranks", trials)
    chosen, first = resolve(path, *ranks)
    assert [c.runtime.layout.layers for c in trials.ran] == [CHOICE, "F"]  # both on the two ranks
    assert all(c.runtime.launch.ranks == 2 for c in trials.ran)
    assert "; validated (3 steps each): " in first
    assert "; routes replicated/gpu, the config's" in first
    (stored,) = cache.glob("selection-*.json")
    policy = json.loads(stored.read_text())["plan"]["policy"]
    assert (policy["param_route"], policy["grad_route"]) == ("replicated", "gpu")
    _no_selection(monkeypatch)
    monkeypatch.setattr(measure, "measure_in_child", None)  # calling it fails the test
    again, line = resolve(path, *ranks)
    assert line.startswith(f"{first}; from the cache {stored} ")
    rt, was = again.runtime, chosen.runtime
    assert (rt.layout.layers, rt.layout.param_route, rt.layout.grad_route) == (
        was.layout.layers,
        "replicated",
        "gpu",
    )
    assert len(trials.ran) == 2  # the cached choice: no trial again


def test_the_launchers_choice_slower_on_the_ranks_leaves_the_default(
    run: tuple[Path, Path, FakeTrials], monkeypatch: pytest.MonkeyPatch
) -> None:
    """``runtime.ranks=2``: validated slower than the default on the ranks, the launcher's
    choice gives way to the default, on the config's routes."""
    from slidedp.autopolicy import measure

    path, _, _ = run

    def measured_here(cfg: TrainConfig) -> float:
        _profile_here(profile_spec(cfg))
        return 0.1

    monkeypatch.setattr(measure, "measure_in_child", measured_here)
    trials = FakeTrials({"F": 1.0, "*": 2.0})
    monkeypatch.setattr(validate, "trial_on_ranks", trials)
    chosen, line = resolve(path, "runtime.ranks=2", "runtime.device=cpu")
    assert [c.runtime.layout.layers for c in trials.ran] == [CHOICE, "F"]
    rt = chosen.runtime
    assert (rt.layout.layers, rt.layout.param_route, rt.layout.grad_route) == (
        ALL_F,
        "replicated",
        "gpu",
    )
    assert "; routes replicated/gpu, the config's (validated); " in line
    assert "did not run faster in validation" in line


def test_plan_and_auto_resolve_the_same_plan(
    run: tuple[Path, Path, FakeTrials], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """`slidedp plan`'s policy file and ``runtime.policy: auto`` selecting afresh from the same
    measurements (``policy_force``: not from the plan's cache entry) give one ``Plan``."""

    path, _, _ = run
    probe = Machine.probe

    def with_gpu(cfg: TrainConfig, *args: Any, **kwargs: Any) -> Machine:
        return dataclasses.replace(probe(cfg, *args, **kwargs), gpu_total_bytes=80 * GIB)

    monkeypatch.setattr(Machine, "probe", with_gpu)
    monkeypatch.setattr(choose, "profile_layer", _profile_here)
    policy = tmp_path / "plan.json"
    assert main(["plan", str(path), "--out", str(policy)]) == 0
    chosen, _ = resolve(path, "runtime.policy_force=true")
    from_file = load_config(path, [f"runtime.policy={policy}"])
    adapter = HFAdapter.from_dir(chosen.model.path)
    on = Machine.probe(chosen, measure=False)
    assert chosen.runtime.layout.layers == CHOICE  # the program's pick, validated faster
    assert resolve_plan(chosen, adapter, on) == resolve_plan(from_file, adapter, on)
