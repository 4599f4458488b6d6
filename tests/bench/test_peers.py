"""The peers of ``slidedp bench train`` on CPU: the registry, a peer that cannot run as one line,
``--peer-set``, a peer's variants (``SYSTEM:LABEL``), the DeepSpeed config, GPU-resident FSDP2,
``--system-timeout``, and the DeepSpeed runs themselves where DeepSpeed is installed (it is not a
test dependency)."""

from __future__ import annotations

import dataclasses
import importlib.util
import json
import os
import re
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from bench.tiny import fake_sweep, tiny_spec, write_tiny_config
from slidedp.bench import train as bench_train
from slidedp.bench import worker
from slidedp.bench.child import run_child
from slidedp.bench.deepspeed_zero import zero_config
from slidedp.bench.peers import (
    PEERS,
    Peer,
    PeerUnavailable,
    merged,
    parse_peer_sets,
    peer_overrides,
    require,
)
from slidedp.bench.train import system_timeouts
from slidedp.cli import build_parser, main
from slidedp.config import TrainSection
from slidedp.errors import ConfigError

HAVE_DEEPSPEED = importlib.util.find_spec("deepspeed") is not None


def test_every_system_has_a_worker_and_peers_are_opt_in() -> None:
    assert set(bench_train.SYSTEMS) <= set(worker.SYSTEMS)
    assert set(PEERS) == {
        "zero3-offload", "zero3-optim-offload", "zero-offload", "fsdp2-resident", "roundpipe"
    }  # fmt: skip
    assert set(bench_train.SYSTEMS) == {*bench_train.DEFAULT_SYSTEMS, *PEERS}
    parser = __import__("slidedp.cli", fromlist=["build_parser"]).build_parser()
    args = parser.parse_args(["bench", "train"])
    assert args.systems == "ours,reference,fsdp2"


@pytest.mark.e2e
def test_the_engine_and_the_bench_never_import_a_peer_package() -> None:
    code = (
        "import sys\n"
        "import slidedp.cli, slidedp.runtime.engine, slidedp.bench.train, slidedp.bench.worker\n"
        "import slidedp.bench.deepspeed_zero, slidedp.bench.roundpipe_sync\n"
        "print(sorted(m for m in ('deepspeed', 'roundpipe') if m in sys.modules))\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]"


def test_a_peer_that_is_not_installed_is_one_line(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setitem(sys.modules, "deepspeed", None)  # import fails as if not installed
    result = worker.run(tiny_spec(tmp_path, "zero3-offload"))
    assert result["status"] == "unavailable"
    assert result["error"].startswith("zero3-offload: deepspeed is not installed (")
    assert result["error"].endswith(
        "pip install 'slidedp[peers]'; on a machine without an index: docs/benchmarks.md"
    )
    assert "\n" not in result["error"]


def test_a_peer_that_fails_at_import_is_one_line(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    (tmp_path / "broken_peer.py").write_text("raise ValueError('no GPU here\\nmore detail')\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.setitem(PEERS, "roundpipe", Peer("broken_peer", needs_cuda=False))
    with pytest.raises(PeerUnavailable) as caught:
        require("roundpipe", "cpu")
    assert str(caught.value) == "roundpipe: importing broken_peer failed: ValueError: no GPU here"


def test_peer_sets_nest_read_yaml_and_refuse_unknown_peers() -> None:
    sets = parse_peer_sets(
        [
            "zero3-offload.zero_optimization.stage3_prefetch_bucket_size=1e8",
            "zero3-offload.zero_optimization.overlap_comm=false",
            "zero3-offload.gradient_clipping=0.5",
            "roundpipe.num_microbatch=4",
        ]
    )
    assert sets == {
        "zero3-offload": {
            "zero_optimization": {
                "stage3_prefetch_bucket_size": 100_000_000,
                "overlap_comm": False,
            },
            "gradient_clipping": 0.5,
        },
        "roundpipe": {"num_microbatch": 4},
    }
    for bad in ("deepspeed.x=1", "zero3-offload=1", "zero3-offload.x", "roundpipe.x=[1"):
        with pytest.raises(ConfigError, match="--peer-set"):
            parse_peer_sets([bad])
    base = {"a": {"b": 1, "c": 2}, "d": 3}
    assert merged(base, {"a": {"b": 5}}) == {"a": {"b": 5, "c": 2}, "d": 3}
    assert base == {"a": {"b": 1, "c": 2}, "d": 3}


def _bench_error(capsys: pytest.CaptureFixture[str], *args: str) -> str:
    """The one line ``slidedp bench train ARGS`` (exit 2) prints, refused before any run."""
    assert main(["bench", "train", "--device", "cpu", *args]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1, err
    return err.removeprefix("slidedp bench train: error: ").strip()


def test_a_variant_is_a_peer_and_a_label_each_mistake_one_line(
    capsys: pytest.CaptureFixture[str],
) -> None:
    systems = ["ours", "zero3-offload", "zero3-offload:big", "zero3-offload:pf-5e8_v1.5"]
    args = build_parser().parse_args(["bench", "train", "--systems", ",".join(systems)])
    assert bench_train._parse(args)[1] == systems
    subset = (
        "use a comma-separated subset of ours,reference,fsdp2,zero3-offload,zero3-optim-offload,"
        "zero-offload,"
    )
    assert _bench_error(capsys, "--systems", "ours,deepspeed:big") == (
        f"--systems 'ours,deepspeed:big': {subset}fsdp2-resident,roundpipe"
    )
    label = "a LABEL is letters, digits, '-', '_' and '.'"
    for bad in ("zero3-offload:a/b", "zero3-offload:", "zero3-offload:a:b"):
        assert _bench_error(capsys, "--systems", f"ours,{bad}") == (
            f"--systems 'ours,{bad}': {bad!r}: {label}"
        )
    for system in ("reference", "fsdp2"):
        assert _bench_error(capsys, "--systems", f"ours,{system}:x") == (
            f"--systems 'ours,{system}:x': '{system}:x': only ours and a peer (zero3-offload, "
            "zero3-optim-offload, zero-offload, fsdp2-resident, roundpipe) have variants, told "
            "apart by --set "
            "ours:LABEL.KEY=VALUE and --peer-set (reference and fsdp2 have no config to set)"
        )
    assert bench_train._parse(build_parser().parse_args(["bench", "train", "--systems",
                                                         "ours,ours:auto"]))[1] == [
        "ours", "ours:auto"
    ]  # fmt: skip
    assert _bench_error(capsys, "--systems", "zero3-offload:a,zero3-offload:a") == (
        "--systems 'zero3-offload:a,zero3-offload:a': 'zero3-offload:a': named twice"
    )
    item = "zero3-offload:big.zero_optimization.reduce_bucket_size=5e8"
    assert _bench_error(capsys, "--systems", "ours,zero3-offload", "--peer-set", item) == (
        f"--peer-set '{item}': the variant zero3-offload:big is not in --systems "
        "'ours,zero3-offload'; name it there too"
    )
    with pytest.raises(ConfigError, match=r"--peer-set 'ours:x\.a=1': use SYSTEM\.KEY=VALUE"):
        parse_peer_sets(["ours:x.a=1"], ["ours", "ours:x"])  # ours' variants take --set


def test_a_variant_runs_with_its_peers_overrides_then_its_own() -> None:
    systems = ["ours", "zero3-offload", "zero3-offload:big", "zero3-offload:v1.5", "zero-offload:x"]
    sets = parse_peer_sets(
        [
            "zero3-offload:big.zero_optimization.reduce_bucket_size=5e8",  # before the base's
            "zero3-offload.zero_optimization.reduce_bucket_size=1e8",
            "zero3-offload.zero_optimization.overlap_comm=false",
            "zero3-offload:big.gradient_clipping=0.5",
            "zero3-offload:v1.5.zero_optimization.stage3_max_live_parameters=3e8",  # a dotted label
        ],
        systems,
    )
    assert peer_overrides(sets, systems) == {
        "zero3-offload": {
            "zero_optimization": {"reduce_bucket_size": 10**8, "overlap_comm": False}
        },
        "zero3-offload:big": {
            "zero_optimization": {"reduce_bucket_size": 5 * 10**8, "overlap_comm": False},
            "gradient_clipping": 0.5,
        },
        "zero3-offload:v1.5": {
            "zero_optimization": {
                "reduce_bucket_size": 10**8, "overlap_comm": False,
                "stage3_max_live_parameters": 3 * 10**8,
            }
        },
    }  # fmt: skip
    assert sets["zero3-offload"] == {  # the base never gets a variant's keys
        "zero_optimization": {"reduce_bucket_size": 10**8, "overlap_comm": False}
    }
    train = TrainSection(max_steps=1, max_grad_norm=1.0)
    big = zero_config(3, train, 8, 64, peer_overrides(sets, systems)["zero3-offload:big"])
    assert big["zero_optimization"]["reduce_bucket_size"] == 5 * 10**8
    assert big["zero_optimization"]["stage3_prefetch_bucket_size"] == int(0.9 * 64**2)
    assert big["gradient_clipping"] == 0.5


def test_variants_are_rows_ratios_timeouts_and_summaries_of_their_own(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """DeepSpeed is not installed here: the workers are replaced by results a worker would
    write, and the test checks what each run was given and what the report makes of it."""
    pytest.importorskip("matplotlib")
    step_s = {"ours": 0.5, "zero3-offload": 1.0, "zero3-offload:big": 2.0, "zero3-offload:s": 1.5}
    specs, figures, out = fake_sweep(
        monkeypatch, tmp_path, step_s,
        "--systems", "ours,zero3-offload,zero3-offload:big,zero3-offload:s",
        "--system-timeout", "100,zero3-offload=200,zero3-offload:big=300",
        "--peer-set", "zero3-offload.zero_optimization.overlap_comm=false",
        "--peer-set", "zero3-offload:big.zero_optimization.reduce_bucket_size=5e8",
    )  # fmt: skip
    by_name = {(s.full_system, s.batch): s for s in specs}
    base, big, small = (by_name[name, 2] for name in ("zero3-offload", "zero3-offload:big",
                                                       "zero3-offload:s"))  # fmt: skip
    # each runs as zero3-offload (the same worker), with its own name, overrides and limit
    assert (base.system, big.system, small.system) == ("zero3-offload",) * 3
    assert (base.variant, big.variant, small.variant) == ("", "big", "s")
    assert len({base.name, big.name, small.name}) == 3  # their spec and result files apart
    assert base.peer == small.peer == {"zero_optimization": {"overlap_comm": False}}
    assert big.peer == {"zero_optimization": {"overlap_comm": False, "reduce_bucket_size": 5e8}}
    assert (base.timeout_s, big.timeout_s, small.timeout_s) == (200, 300, 100)
    # one bench directory: DeepSpeed's ops (deepspeed_zero.extensions_dir) built there once
    assert len({s.config_dir for s in specs}) == 1
    report = json.loads(out.read_text())
    assert [(r["system"], r["batch"]) for r in report["runs"]] == [
        (s, b) for b in (2, 4) for s in ("ours", "zero3-offload", "zero3-offload:big",
                                         "zero3-offload:s")
    ]  # fmt: skip
    assert report["peer_sets"] == {
        "zero3-offload": base.peer, "zero3-offload:big": big.peer, "zero3-offload:s": small.peer,
    }  # fmt: skip
    assert report["system_timeout_s"] == {
        "ours": 100, "zero3-offload": 200, "zero3-offload:big": 300, "zero3-offload:s": 100,
    }  # fmt: skip
    for row in report["ratios"]:
        assert row["ours_over_zero3-offload"] == pytest.approx(2.0)
        assert row["ours_over_zero3-offload:big"] == pytest.approx(4.0)
        assert row["ours_over_zero3-offload:s"] == pytest.approx(3.0)
    geomeans = {p["system"]: p["geomean_ours_over_peer"] for p in report["summary"]["peers"]}
    assert geomeans == {
        "zero3-offload": pytest.approx(2.0), "zero3-offload:big": pytest.approx(4.0),
        "zero3-offload:s": pytest.approx(3.0),
    }  # fmt: skip
    printed = capsys.readouterr().out
    assert "ratios at batch 2 (tokens/s): ours/zero3-offload 2.00x, " \
        "ours/zero3-offload:big 4.00x, ours/zero3-offload:s 3.00x" in printed  # fmt: skip
    assert "summary: ours/zero3-offload:big: geometric mean 4.00x over batches 2, 4" in printed
    (figure,) = figures
    legend = [t.get_text() for t in figure.axes[0].get_legend().get_texts()]
    assert legend == ["ours", "zero3-offload (ours 2.00x)", "zero3-offload:big (ours 4.00x)",
                      "zero3-offload:s (ours 3.00x)"]  # fmt: skip


@pytest.mark.e2e
def test_two_variants_of_a_peer_end_to_end_on_cpu(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """GPU-resident FSDP2 runs on CPU: a peer and two variants of it, each in its own worker,
    each told its own overrides (FSDP2 takes none: the worker's record of what it was given),
    each the same training as the peer, and the peer the same training as FSDP2 with its state
    offloaded (a test of two workers of its own once). The same command runs a peer that cannot
    run here (one worker more, not a bench of its own)."""
    config = write_tiny_config(tmp_path / "m")
    out = tmp_path / "r.json"
    args = ["bench", "train", "--shape", str(config), "--seq", "16", "--device", "cpu"]
    # losses after one and two updates (the first step's, before any, would be the same
    # wherever the state lives)
    args += ["--batch", "2", "--warmup", "1", "--steps", "2", "--json", str(out)]
    args += ["--systems", "ours,fsdp2,fsdp2-resident,fsdp2-resident:a,fsdp2-resident:b,roundpipe"]
    for item in ("fsdp2-resident.x=1", "fsdp2-resident.y=1", "fsdp2-resident:a.x=2",
                 "fsdp2-resident:b.z=3"):  # fmt: skip
        args += ["--peer-set", item]
    assert main(args) == 0
    report = json.loads(out.read_text())
    ours, offload, peer, a, b, _ = report["runs"]
    assert [r["system"] for r in (offload, peer, a, b)] == [
        "fsdp2", "fsdp2-resident", "fsdp2-resident:a", "fsdp2-resident:b"
    ]  # fmt: skip
    assert all(r["status"] == "ok" for r in (ours, offload, peer, a, b))
    # same weights, tokens and AdamW: on CPU the two differ only in where FSDP2 keeps the state
    assert len(offload["losses"]) == 2
    assert peer["losses"] == pytest.approx(offload["losses"], rel=1e-5)
    assert "peer_set" not in ours
    assert peer["peer_set"] == {"x": 1, "y": 1}
    assert a["peer_set"] == {"x": 2, "y": 1}
    assert b["peer_set"] == {"x": 1, "y": 1, "z": 3}
    assert a["losses"] == pytest.approx(peer["losses"], rel=1e-5)
    assert b["losses"] == pytest.approx(peer["losses"], rel=1e-5)
    (row,) = report["ratios"]
    for name in ("fsdp2-resident", "fsdp2-resident:a", "fsdp2-resident:b"):
        theirs = next(r for r in report["runs"] if r["system"] == name)["tokens_per_s"]
        assert row[f"ours_over_{name}"] == pytest.approx(ours["tokens_per_s"] / theirs)
    _a_peer_that_cannot_run_here_is_a_row_and_a_summary_line(report, capsys.readouterr().out)


def _a_peer_that_cannot_run_here_is_a_row_and_a_summary_line(
    report: dict[str, Any], printed: str
) -> None:
    """Not a failure (the command exited 0): a row and a line of the summary."""
    peer = report["runs"][-1]
    assert (peer["system"], peer["status"], peer["error"]) == (
        "roundpipe",
        "unavailable",
        "roundpipe needs CUDA (this run is on cpu)",
    )
    (summary,) = [p for p in report["summary"]["peers"] if p["system"] == "roundpipe"]
    assert summary["unavailable"] == peer["error"]
    assert re.search(r"^ +2 roundpipe +UNAVAILABLE +roundpipe needs CUDA \(this run is on cpu\)$",
                     printed, re.MULTILINE)  # fmt: skip
    assert "summary: ours/roundpipe: not run (roundpipe needs CUDA (this run is on cpu))" in printed


def test_the_deepspeed_configs_follow_the_fine_tuning_guides() -> None:
    train = TrainSection(
        max_steps=1, learning_rate=2e-5, adam_beta1=0.8, adam_beta2=0.95, adam_epsilon=1e-6,
        weight_decay=0.1, max_grad_norm=1.0,
    )  # fmt: skip
    three = zero_config(3, train, batch=16, hidden=2560)
    assert three["train_batch_size"] == three["train_micro_batch_size_per_gpu"] == 16
    assert three["gradient_accumulation_steps"] == 1
    assert three["bf16"] == {"enabled": True}
    assert three["gradient_clipping"] == 1.0
    assert three["optimizer"] == {
        "type": "AdamW",
        "params": {"lr": 2e-5, "betas": [0.8, 0.95], "eps": 1e-6, "weight_decay": 0.1},
    }
    pinned_cpu = {"device": "cpu", "pin_memory": True}
    assert three["zero_optimization"] == {
        "stage": 3, "offload_param": pinned_cpu, "offload_optimizer": pinned_cpu,
        "overlap_comm": True, "contiguous_gradients": True, "sub_group_size": 10**9,
        "reduce_bucket_size": 2560**2, "stage3_prefetch_bucket_size": int(0.9 * 2560**2),
        "stage3_param_persistence_threshold": 25_600, "stage3_max_live_parameters": 10**9,
        "stage3_max_reuse_distance": 10**9,
    }  # fmt: skip
    two = zero_config(2, dataclasses.replace(train, max_grad_norm=0.0), batch=4, hidden=64)
    assert two["gradient_clipping"] == 0.0
    assert two["zero_optimization"] == {
        "stage": 2, "offload_optimizer": pinned_cpu, "overlap_comm": True,
        "contiguous_gradients": True, "reduce_bucket_size": 4096, "allgather_partitions": True,
        "allgather_bucket_size": 4096,
    }  # fmt: skip
    tuned = zero_config(
        3, train, 16, 2560, {"zero_optimization": {"stage3_prefetch_bucket_size": 5 * 10**8}}
    )
    assert tuned["zero_optimization"]["stage3_prefetch_bucket_size"] == 5 * 10**8
    assert tuned["zero_optimization"]["offload_param"] == pinned_cpu


def test_system_timeouts_have_a_default_and_per_system_values() -> None:
    systems = ["ours", "zero3-offload", "fsdp2"]
    assert system_timeouts(None, systems) == {"ours": 0.0, "zero3-offload": 0.0, "fsdp2": 0.0}
    assert system_timeouts("120,zero3-offload=200", systems) == {
        "ours": 120.0, "zero3-offload": 200.0, "fsdp2": 120.0,
    }  # fmt: skip
    assert system_timeouts("fsdp2=90", systems) == {"ours": 0.0, "zero3-offload": 0.0, "fsdp2": 90}
    for bad in ("0", "-5", "soon", "roundpipe=10", "ours=", "120,,ours=5"):
        with pytest.raises(ConfigError, match="--system-timeout"):
            system_timeouts(bad, systems)


@pytest.mark.e2e
def test_a_run_past_the_system_timeout_is_killed_and_reported(tmp_path: Path) -> None:
    # A worker spends well over 0.3 s importing torch before its first step.
    spec = dataclasses.replace(tiny_spec(tmp_path, "reference"), timeout_s=0.3)
    result, _ = run_child(spec, tmp_path)
    assert (result["status"], result["error"]) == (
        "timeout",
        "ran past --system-timeout 0.3 s; killed",
    )


@pytest.mark.skipif(not HAVE_DEEPSPEED, reason="DeepSpeed is not installed (slidedp[peers])")
def test_zero_peers_train_the_fsdp2_model_on_cpu(tmp_path: Path) -> None:
    fsdp2, _ = run_child(tiny_spec(tmp_path, "fsdp2"), tmp_path)
    for system in ("zero3-offload", "zero-offload"):
        result, _ = run_child(tiny_spec(tmp_path, system), tmp_path)
        assert result["status"] == "ok", result
        assert result["optimizer"] == "DeepSpeedCPUAdam"
        # the same initial weights and tokens: the first losses agree to bf16 rounding
        assert result["losses"][0] == pytest.approx(fsdp2["losses"][0], rel=1e-3)


def test_deepspeed_builds_its_ops_where_no_stale_lock_can_block_it(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A DeepSpeed run killed while compiling its CPU Adam leaves torch's build lock behind, and
    the next run waits on it forever. The build goes to the bench's own directory, where every
    lock found at a run's start is stale and removed. Stopped (without DeepSpeed) where
    DeepSpeed would be imported, then its op built: torch's own lookup of the build directory
    and its lock, as ``cpu_adam``'s just-in-time build goes through them."""
    from torch.utils.cpp_extension import _get_build_directory
    from torch.utils.file_baton import FileBaton

    from slidedp.bench import deepspeed_zero

    shared = tmp_path / "cache" / "torch_extensions"  # as ~/.cache/torch_extensions
    spec = tiny_spec(tmp_path / "bench", "zero3-offload")
    killed_here = Path(spec.config_dir) / "torch_extensions" / "cpu_adam" / "lock"
    for lock in (shared / "cpu_adam" / "lock", killed_here):
        lock.parent.mkdir(parents=True)
        lock.touch()
    monkeypatch.setenv("TORCH_EXTENSIONS_DIR", str(shared))
    acquired = []

    def build_cpu_adam(system: str, device: str) -> None:
        baton = FileBaton(str(Path(_get_build_directory("cpu_adam", verbose=False), "lock")))
        acquired.append(baton.try_acquire())
        baton.release()
        raise PeerUnavailable("stopped before DeepSpeed")

    monkeypatch.setattr(deepspeed_zero, "require", build_cpu_adam)
    with pytest.raises(PeerUnavailable):
        deepspeed_zero.run_zero(spec)
    assert acquired == [True]
    assert Path(os.environ["TORCH_EXTENSIONS_DIR"]) == killed_here.parent.parent


def test_roundpipes_transformers_4_mask_keywords_build_the_same_mask() -> None:
    """RoundPipe 0.1.1's Qwen3 preset calls the mask builders with transformers 4's keywords
    (``input_embeds``, ``cache_position``, ``past_key_values``); adapted, the call builds the
    mask the installed transformers builds from its own keywords, and adapting twice wraps
    once."""
    import types

    import torch
    from transformers import masking_utils

    from bench.tiny import tiny_config
    from slidedp.bench.roundpipe_sync import MASK_BUILDERS, _adapt_mask_builders
    from slidedp.models.hf import no_cache

    preset = types.ModuleType("preset")
    for name in MASK_BUILDERS:
        setattr(preset, name, getattr(masking_utils, name))
    _adapt_mask_builders(preset)
    _adapt_mask_builders(preset)
    config = tiny_config(use_sliding_window=True, sliding_window=8)
    config._attn_implementation = "eager"
    embeds = torch.zeros(2, 12, config.hidden_size)
    positions = torch.arange(12).unsqueeze(0)
    masks = []
    for name in MASK_BUILDERS:
        builder = getattr(preset, name)
        assert builder.__wrapped__ is getattr(masking_utils, name)
        old = builder(config=config, input_embeds=embeds, attention_mask=None,
                      cache_position=torch.arange(12), past_key_values=None,
                      position_ids=positions)  # fmt: skip
        builder_now = getattr(masking_utils, name)
        new = builder_now(config=config, inputs_embeds=embeds, attention_mask=None,
                          position_ids=positions, **no_cache(builder_now))  # fmt: skip
        assert torch.equal(old, new)
        masks.append(old)
    assert not torch.equal(*masks)  # the sliding window's mask is not the causal one
    with pytest.raises(TypeError):  # any other mismatch is still an error, never dropped
        preset.create_causal_mask(config=config, input_embeds=embeds, attention_mask=None,
                                  past_key_values=None, no_such_keyword=1)  # fmt: skip


def test_roundpipes_layers_get_their_attention_type_from_the_config() -> None:
    """transformers 5's decoder layers keep their kind in ``config.layer_types`` only;
    RoundPipe 0.1.1's preset reads it from each layer."""
    import torch
    from transformers import AutoModelForCausalLM

    from bench.tiny import tiny_config
    from slidedp.bench.roundpipe_sync import _adapt_layers

    config = tiny_config(use_sliding_window=True, sliding_window=8, max_window_layers=1)
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config)  # type: ignore[no-untyped-call]
    for layer in model.model.layers:
        if hasattr(layer, "attention_type"):
            del layer.attention_type
    _adapt_layers(model, config)
    kinds = config.layer_types
    assert kinds is not None
    assert len(set(kinds)) == 2  # both kinds, each on its own layer
    assert [layer.attention_type for layer in model.model.layers] == kinds
