"""``slidedp estimate`` and the train-time refusal: formulas, the exact store size, the Qwen3-4B
measurements of BENCHMARKS.md (meta config, nothing allocated), the CLI."""

from __future__ import annotations

import json
import resource
from dataclasses import replace
from pathlib import Path
from typing import Literal

import pytest
import torch
from transformers import Qwen3Config

from cli.util import one_error_line, run
from engine.tiny import make_model, write_config, write_data
from estimate.machines import H100
from host_profile.fake import cache_rate
from slidedp.cli import main
from slidedp.config import TrainConfig, load_config
from slidedp.errors import OutOfDeviceMemoryError
from slidedp.estimate import COMPILE_WORKER_BYTES, CUDA_PROCESS_BYTES, check_fits, shortages
from slidedp.estimate_report import Estimate, estimate_run, format_estimate, longest_sequence
from slidedp.models.hf import HFAdapter
from slidedp.models.shapes import SHAPES
from slidedp.plan.cost import layer_footprint
from slidedp.plan.layout import LayerPolicy
from slidedp.plan.machine import GIB, Machine, adamw_gbps, update_threads
from slidedp.plan.policy import layer_chunk_elems
from slidedp.plan.predict import CalibratedPrediction
from slidedp.plan.resolve import plan_store, resolve_mirror
from slidedp.runtime.flops import model_flops_per_token
from slidedp.runtime.routes import signal_args
from slidedp.store import HostStore
from slidedp.store_layout import Dtype

Capsys = pytest.CaptureFixture[str]
CPU = Machine(
    device="cpu",
    dtype="float32",
    cores=2,
    shm_free_bytes=20 * GIB,
    mem_available_bytes=20 * GIB,
    cpu_flops=100e9,
)


@pytest.fixture(scope="module")
def tiny(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_model(tmp_path_factory.mktemp("models"), "qwen3", tied=False)


@pytest.fixture(scope="module")
def qwen3_4b(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The published Qwen3-4B config only: the adapter builds it on the meta device."""
    path = tmp_path_factory.mktemp("models") / "qwen3-4b"
    Qwen3Config(**SHAPES["qwen3-4b"]).save_pretrained(path)
    return path


def _cfg(tmp_path: Path, model: Path, *overrides: str) -> TrainConfig:
    data = write_data(tmp_path / "data.jsonl", 8)
    path = write_config(tmp_path / "c.yaml", model, data, tmp_path / "out")
    return load_config(path, list(overrides))


@pytest.mark.parametrize("overrides", [(), ("runtime.chunk_elems=1000", "runtime.grad_slots=3")])
def test_store_estimate_is_a_created_store_exactly(
    tmp_path: Path, tiny: Path, overrides: tuple[str, ...]
) -> None:
    cfg = _cfg(tmp_path, tiny, *overrides)
    adapter = HFAdapter.from_dir(tiny)
    est = estimate_run(cfg, adapter, CPU)
    rt = cfg.runtime
    store = HostStore.create(  # as Trainer creates it
        adapter.group_specs(),
        staging_slots=rt.layout.staging_slots,
        grad_dtype="f32",
        grad_slots=rt.layout.grad_slots,
        chunk_elems=rt.layout.chunk_elems or layer_chunk_elems(adapter),
    )
    assert est.store_bytes == est.shm_bytes == store.total_bytes
    assert plan_store(cfg, adapter, CPU) == store.layout


@pytest.mark.parametrize(("dtype", "landing"), [("float32", "f32"), ("bfloat16", "bf16")])
def test_the_cpu_routes_landing_slots_count_in_shm_exactly(
    tmp_path: Path, tiny: Path, dtype: Literal["float32", "bfloat16"], landing: Dtype
) -> None:
    """Two ranks on the cpu route: the store's f32 gradient slots (the sums) and the signal
    store with every rank's landing slots in the compute dtype, as the trainer creates them."""
    machine = replace(CPU, dtype=dtype)
    adapter, routes, layouts = HFAdapter.from_dir(tiny), {}, {}
    for route in ("cpu", "gpu"):
        cfg = _cfg(tmp_path, tiny, "runtime.ranks=2", f"runtime.grad_route={route}",
                   "runtime.chunk_elems=1000", "runtime.grad_slots=3")  # fmt: skip
        routes[route] = estimate_run(cfg, adapter, machine)
        layouts[route] = plan_store(cfg, adapter, machine)
    est, layout = routes["cpu"], layouts["cpu"]
    assert layout.grad_dtype == "f32"  # the sums
    signals = HostStore.create(**signal_args(2, 3, landing, layout.slot_len), shm_dir=str(tmp_path))
    assert signals.region("grad").numel() == 2 * 3 * layout.slot_len
    assert est.signal_bytes == signals.total_bytes
    assert est.shm_bytes == est.store_bytes + signals.total_bytes
    counters = HostStore.plan(**signal_args(2, 3, None, layout.slot_len)).regions.total_bytes
    assert routes["gpu"].signal_bytes == counters < signals.total_bytes


def test_tiny_cpu_terms_follow_the_formulas(
    tmp_path: Path, tiny: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # no host probe cached (an earlier test's would replace the table's rate in host_floor_s)
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    cfg = _cfg(tmp_path, tiny, "runtime.offload_ratio=1", "train.global_batch_size=4")
    adapter = HFAdapter.from_dir(tiny)
    est = estimate_run(cfg, adapter, CPU)
    b, s, h, i, layers, vocab = 4, 32, 64, 128, 2, 256  # engine.tiny's model, f32 on CPU
    layer_params = 4 * h * h // 2 + 2 * h * 32 + 3 * h * i + 2 * h + 2 * 16  # q,o; k,v; mlp; norms
    params = layers * layer_params + 2 * vocab * h + h
    assert est.params == params
    arena = layers * b * s * h * 4
    loss = b * s * vocab * 4 * 3  # b*s < loss_chunk_tokens
    layer = layer_footprint(adapter, LayerPolicy("F", ratio=1.0), b, s, torch.float32)
    assert layer.offloaded_bytes == b * s * h * 4  # the input, offloaded
    assert layer.retained_bytes == 0
    layout = plan_store(cfg, adapter, CPU)
    slot = max(layout.groups[g].slot_len for g in (1, 2))
    window = (2 * slot + layout.groups[0].slot_len + layout.groups[3].slot_len) * 4
    # clipping parks f32 gradients, r=1: no inputs kept
    working = window + loss + layer.transient_bytes + params * 4
    assert est.offload_arena_bytes == arena
    assert est.cpu_working_bytes == working
    assert est.ram_bytes == est.store_bytes + arena + int(0.7 * GIB) + working
    assert est.gpu is None
    assert est.pinned_bytes == 0
    flops = model_flops_per_token(adapter.config, s) * b * s * 4 / 3
    assert est.step.flops_per_step == pytest.approx(flops)
    assert est.step.compute_s == pytest.approx((flops / 90e9, flops / 25e9))
    assert est.step.host_floor_s == pytest.approx(28 * params / 18.0e9)  # one of two cores
    assert est.step.bound == "compute"
    unmeasured = estimate_run(cfg, adapter, replace(CPU, cpu_flops=None)).step
    assert unmeasured.range_s is None
    assert unmeasured.host_floor_s == est.step.host_floor_s


def test_adamw_bandwidth_interpolates_the_measured_table() -> None:
    assert adamw_gbps(16) == 170.4
    assert adamw_gbps(1) == 18.0
    assert adamw_gbps(3) == pytest.approx((31.6 + 62.8) / 2)
    assert adamw_gbps(32) == pytest.approx(2 * 170.4)


def test_the_host_floor_and_the_model_take_this_machines_cached_probe(
    tmp_path: Path, qwen3_4b: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    adapter = HFAdapter.from_dir(qwen3_4b)
    cfg = _cfg(tmp_path, qwen3_4b, "data.seq_len=1024", "train.global_batch_size=16")
    table = estimate_run(cfg, adapter, H100)
    threads = update_threads(cfg, H100)
    assert threads == 15  # the 16 cores but one, left to the training thread
    assert table.step.host_gbps == adamw_gbps(threads)
    not_probed = "from the table (not measured on this machine: slidedp profile host)"
    assert not_probed in format_estimate(table)
    assert table.step_model is not None
    assert "host AdamW" not in table.step_model.calibration

    # an absurd rate under DMA (the alone rate is not what the model takes beside a GPU)
    cache_rate(threads, H100.gpu_name, 9999.0, joint_gbps=1.0)
    probed = estimate_run(cfg, adapter, H100)
    one_pass_s = 28 * probed.params / 1e9
    assert probed.step.host_gbps == 1.0
    assert probed.step.host_floor_s == pytest.approx(one_pass_s)
    assert probed.step.bound == "host (AdamW traffic)"
    assert "at 1 GB/s (15 threads), measured under DMA (cached)" in format_estimate(probed)
    assert probed.step_model is not None
    # the model's update runs alone (9999 GB/s) where no copy overlaps it, under the copies
    # (1 GB/s) for the rest: the copies' share of the step, far from all of it
    assert 28 * probed.params / 9999e9 < probed.step_model.step_s < one_pass_s / 2
    assert probed.step_model.calibration == "host AdamW measured under DMA (cached)"
    # another thread count is another machine state: the table again
    eight = replace(cfg, runtime=cfg.runtime.with_keys(update_threads=8))
    assert estimate_run(eight, adapter, H100).step.host_gbps == adamw_gbps(8)


def test_the_estimate_verb_says_where_the_host_rate_comes_from(
    tmp_path: Path, tiny: Path, monkeypatch: pytest.MonkeyPatch, capsys: Capsys
) -> None:
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    data = write_data(tmp_path / "data.jsonl", 8)
    config = write_config(tmp_path / "c.yaml", tiny, data, tmp_path / "out")
    assert main(["estimate", str(config)]) == 0
    assert "from the table (not measured on this machine" in capsys.readouterr().out
    assert not (tmp_path / "cache").exists()  # estimating never measures the host
    cfg = load_config(config, [])
    machine = Machine.probe(cfg, measure=False)
    cache_rate(update_threads(cfg, machine), None, 1234.0)  # this CPU, the engine's threads
    assert main(["estimate", str(config)]) == 0
    out = capsys.readouterr().out
    assert "at 1234 GB/s" in out
    assert "measured (cached)" in out


# BENCHMARKS.md "Qwen3-4B shape, host memory" (H100, S=1024, 2 layer slots, 2 gradient slots,
# no BF16 mirror): (B, clip, r) ->
# (GPU reserved GiB, host PSS GiB, step time s)
MEASURED = {
    (16, 1.0, 1): (15.0, 50.15, 2.47),
    (16, 1.0, 0): (15.1, 47.30, 2.44),
    (16, 0.0, 1): (7.6, 50.08, 2.91),
    (8, 1.0, 1): (12.9, 48.71, 1.75),
}


@pytest.mark.parametrize("case", sorted(MEASURED))
def test_qwen3_4b_matches_the_measurements_without_allocating(
    tmp_path: Path, qwen3_4b: Path, case: tuple[int, float, int]
) -> None:
    b, clip, r = case
    before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    cfg = _cfg(
        tmp_path,
        qwen3_4b,
        "data.seq_len=1024",
        f"train.global_batch_size={b}",
        f"train.max_grad_norm={clip}",
        f"runtime.offload_ratio={r}",
        "runtime.grad_slots=2",
        "runtime.bf16_mirror=false",
        "runtime.kernels=eager",  # those runs had transformers' modules (Liger: test_liger_memory)
        "runtime.compile=false",  # and were not compiled (no compile workers beside them)
    )
    est = estimate_run(cfg, HFAdapter.from_dir(qwen3_4b), H100)
    grown_kib = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - before
    assert grown_kib < 2**20, "the estimate allocated more than 1 GiB"  # the store is 45.7 GiB
    gpu_gib, pss_gib, step_s = MEASURED[case]
    assert est.gpu is not None
    assert est.gpu.peak_reserved_bytes / GIB == pytest.approx(gpu_gib, rel=0.01)
    assert est.ram_bytes / GIB == pytest.approx(pss_gib, rel=0.005)
    assert est.store_bytes / GIB == pytest.approx(45.73, rel=0.001)
    inputs = 36 * b * 1024 * 2560 * 2
    assert est.offload_arena_bytes == (inputs if r else 0)
    assert est.gpu.checkpoint_bytes == (2 * inputs // 36 if r else inputs)  # r=1: 2 back
    assert est.gpu.parked_grad_bytes == (2 * est.params if clip else 0)
    assert est.gpu.window_bytes / GIB == pytest.approx(1.10, abs=0.005)  # BENCHMARKS.md
    assert est.step.range_s is not None
    assert est.step.range_s[0] <= step_s <= est.step.range_s[1]


@pytest.mark.parametrize("threads", [None, "1"])
def test_compiled_layers_count_inductors_compile_workers(
    tmp_path: Path, qwen3_4b: Path, monkeypatch: pytest.MonkeyPatch, threads: str | None
) -> None:
    """Compiled layers on CUDA: a sidecar and one worker per compile thread (the H100 host's 16
    cores) in host RAM, per rank, as measured beside a run (17 processes of ~363 MB); none when
    torch compiles in one thread or the layers are not compiled."""
    if threads is None:
        monkeypatch.delenv("TORCHINDUCTOR_COMPILE_THREADS", raising=False)
    else:
        monkeypatch.setenv("TORCHINDUCTOR_COMPILE_THREADS", threads)
    base = ("data.seq_len=1024", "runtime.kernels=eager", "runtime.bf16_mirror=false")
    adapter = HFAdapter.from_dir(qwen3_4b)
    compiled = estimate_run(_cfg(tmp_path, qwen3_4b, *base, "runtime.compile=true"), adapter, H100)
    plain = estimate_run(_cfg(tmp_path, qwen3_4b, *base, "runtime.compile=false"), adapter, H100)
    workers = 0 if threads else 17 * COMPILE_WORKER_BYTES
    assert compiled.compile_workers_bytes == workers
    assert compiled.ram_bytes - plain.ram_bytes == workers
    assert plain.compile_workers_bytes == 0


def _on(est: Estimate, machine: Machine) -> Estimate:
    return replace(est, machine=machine)


def test_refusal_names_every_shortage_with_its_numbers(tmp_path: Path, qwen3_4b: Path) -> None:
    cfg = _cfg(
        tmp_path,
        qwen3_4b,
        "data.seq_len=1024",
        "train.global_batch_size=16",
        "runtime.grad_slots=2",  # the measured store: 45.73 GiB
        "runtime.bf16_mirror=false",
        "runtime.kernels=eager",
        "runtime.compile=false",
    )
    est = estimate_run(cfg, HFAdapter.from_dir(qwen3_4b), H100)
    check_fits(est)  # H100 with 100 GiB of /dev/shm: fits
    with pytest.raises(OutOfDeviceMemoryError, match=r"GPU 15\.\d\d GiB needed, 9\.31 GiB total"):
        check_fits(_on(est, replace(H100, gpu_total_bytes=10**10)))
    with pytest.raises(MemoryError) as info:
        check_fits(_on(est, replace(H100, shm_free_bytes=40 * GIB, mem_available_bytes=47 * GIB)))
    message = str(info.value)
    assert "/dev/shm 45.7" in message
    assert "40.00 GiB free" in message
    assert "host RAM 47.3" in message
    assert "47.00 GiB available" in message
    assert "\n" not in message
    assert "enlarge it" in message
    # the shell's limits: validate passed a run whose store then failed to map or to fallocate
    limited = replace(H100, address_space_left_bytes=40 * GIB, file_size_limit_bytes=10 * GIB)
    with pytest.raises(MemoryError) as info:
        check_fits(_on(est, limited))
    message = str(info.value)
    assert "the host store's 45.7" in message
    assert "`ulimit -v` leaves 40.00 GiB" in message
    assert "a /dev/shm file of 45.7" in message
    assert "`ulimit -f` allows 10.00 GiB" in message
    assert "raise the limit" in message
    assert "enlarge it" not in message  # nothing else is short
    assert info.value.available_bytes == 10 * GIB  # type: ignore[attr-defined]


@pytest.mark.parametrize("verb", ["train", "validate"])
def test_cli_refuses_a_run_whose_activations_do_not_fit(
    capsys: Capsys, tmp_path: Path, tiny: Path, verb: str
) -> None:
    """The store of the tiny model fits (the old 12 B/param bound passed it); the offload arena
    of 2**20 rows of 2**16 tokens does not: refused with the numbers, nothing allocated."""
    data = write_data(tmp_path / "data.jsonl", 8)
    out = tmp_path / "out"
    config = write_config(tmp_path / "c.yaml", tiny, data, out)
    overrides = ["train.global_batch_size=1048576", "data.seq_len=65536", "runtime.offload_ratio=1",
                 "model.max_position_embeddings=65536"]  # fmt: skip
    code, _, err = run(capsys, verb, str(config), *overrides)
    assert code == 2
    one_error_line(err, verb, "not enough space in", "host RAM", "GiB needed", "available")
    assert not out.exists()


def test_cli_refuses_a_gpu_that_is_too_small(
    capsys: Capsys, tmp_path: Path, qwen3_4b: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    small = replace(H100, gpu_total_bytes=8 * 10**9)
    monkeypatch.setattr(Machine, "probe", classmethod(lambda cls, *args, **kwargs: small))
    data = write_data(tmp_path / "data.jsonl", 8)
    config = write_config(tmp_path / "c.yaml", qwen3_4b, data, tmp_path / "out")
    code, _, err = run(capsys, "train", str(config), "data.seq_len=1024", "runtime.device=cpu")
    assert code == 2
    one_error_line(err, "train", "GPU ", "GiB needed", "7.45 GiB total", "global_batch_size")


def test_estimate_verb_table_and_json(capsys: Capsys, tmp_path: Path, tiny: Path) -> None:
    data = write_data(tmp_path / "data.jsonl", 8)
    config = write_config(tmp_path / "c.yaml", tiny, data, tmp_path / "out")
    code, out, _ = run(capsys, "estimate", str(config))
    assert code == 0
    for needle in ("/dev/shm (host store)", "host RAM", "step time", "host AdamW floor", "fits"):
        assert needle in out, needle
    code, out, _ = run(capsys, "estimate", str(config), "train.global_batch_size=2", "--json")
    assert code == 0
    info = json.loads(out)
    assert set(info) >= {
        "params",
        "store_bytes",
        "shm_bytes",
        "ram_bytes",
        "pinned_bytes",
        "offload_arena_bytes",
        "gpu",
        "step",
        "machine",
        "fits",
        "shortages",
    }
    assert info["batch"] == 2
    assert info["fits"]
    assert info["shortages"] == []
    assert set(info["step"]) >= {"range_s", "compute_s", "host_floor_s", "bound", "peak_flops"}
    assert not (tmp_path / "out").exists()


# BENCHMARKS.md (H200 with --gpu-limit 80 --host-limit 120; 4B on H100): S=1024, no clipping,
# r=0, 4 gradient slots, the BF16 mirror on: shape -> (batch, host PSS GiB)
MEASURED_MIRROR = {"qwen3-4b": (16, 54.61), "qwen3-8b": (16, 109.62)}


@pytest.mark.parametrize("shape", sorted(MEASURED_MIRROR))
def test_the_mirror_is_on_by_default_where_it_fits_the_host_with_room(
    tmp_path: Path, shape: str
) -> None:
    model = tmp_path / shape
    Qwen3Config(**SHAPES[shape]).save_pretrained(model)
    adapter = HFAdapter.from_dir(model)
    b, pss_gib = MEASURED_MIRROR[shape]
    # those runs' layers were not compiled (Liger's kernels): no compile workers beside them
    cfg = _cfg(tmp_path, model, "data.seq_len=1024", f"train.global_batch_size={b}",
               "train.max_grad_norm=0", "runtime.compile=false")  # fmt: skip
    host = replace(H100, shm_free_bytes=128 * GIB, mem_available_bytes=122 * GIB)  # 125 GiB RAM
    assert resolve_mirror(cfg, adapter, host)
    est = estimate_run(cfg, adapter, host)
    assert est.mirror_bytes == pytest.approx(2 * est.params, rel=1e-3)
    assert est.ram_bytes / GIB == pytest.approx(pss_gib, rel=0.01)
    # without 8 GiB to spare beyond the run, casting on delivery: the smaller footprint
    tight = replace(host, mem_available_bytes=est.ram_bytes + 8 * GIB - 1)
    assert not resolve_mirror(cfg, adapter, tight)
    smaller = estimate_run(cfg, adapter, tight)
    assert smaller.mirror_bytes == 0
    assert smaller.store_bytes < est.store_bytes
    # as set, whatever the machine; never in f32; unknown RAM: off
    on = replace(cfg, runtime=cfg.runtime.with_keys(bf16_mirror=True))
    assert resolve_mirror(on, adapter, tight)
    off = replace(cfg, runtime=cfg.runtime.with_keys(bf16_mirror=False))
    assert not resolve_mirror(off, adapter, host)
    assert not resolve_mirror(on, adapter, replace(host, dtype="float32"))
    assert not resolve_mirror(cfg, adapter, replace(host, mem_available_bytes=None))


def test_on_a_gpu_the_step_time_model_predicts_a_step_and_its_regime(
    tmp_path: Path, qwen3_4b: Path
) -> None:
    adapter = HFAdapter.from_dir(qwen3_4b)

    def model(*overrides: str) -> CalibratedPrediction:
        cfg = _cfg(tmp_path, qwen3_4b, "data.seq_len=1024", *overrides)
        est = estimate_run(cfg, adapter, H100)
        assert est.step_model is not None
        return est.step_model

    free = model("train.global_batch_size=16", "train.max_grad_norm=0")
    clipped = model("train.global_batch_size=16", "train.max_grad_norm=1")
    small = model("train.global_batch_size=4", "train.max_grad_norm=1")
    layout = model("train.global_batch_size=16", "train.max_grad_norm=0", "runtime.layers=N")
    # measured (BENCHMARKS.md, H100): 1.72 s, 2.17 s, 1.06 s; the model is uncalibrated and
    # predicts 8-16% short, but orders them and names what binds each
    assert 1.4 < free.step_s < 1.8
    assert clipped.step_s > free.step_s + 0.15  # the updates wait for the norm
    assert str(small.regime).startswith("Update-bound")  # one AdamW pass binds B=4
    assert layout.step_s < free.step_s - 0.2  # no replay in any layer
    assert estimate_run(_cfg(tmp_path, qwen3_4b), adapter, CPU).step_model is None


def test_the_longest_sequence_fits_and_the_next_one_does_not(
    tmp_path: Path, qwen3_4b: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """Qwen3-4B at B=1 with activation offload on a 16 GB GPU: bisected over the estimate,
    the longest multiple of 1024 that fits, the next one short of GPU memory; a GPU large
    enough for every length stops at the model's position limit."""
    adapter = HFAdapter.from_dir(qwen3_4b)
    cfg = _cfg(tmp_path, qwen3_4b, "train.global_batch_size=1", "runtime.offload_ratio=1")
    gpu = replace(H100, gpu_total_bytes=16 * 10**9)
    found = longest_sequence(cfg, adapter, gpu)
    assert 0 < found.seq_len < 40960
    assert found.limit.startswith(f"{found.seq_len + 1024:,} tokens: GPU ")

    def fits(tokens: int) -> bool:
        data = replace(cfg.data, seq_len=tokens)
        return not shortages(estimate_run(replace(cfg, data=data), adapter, gpu))

    assert fits(found.seq_len)
    assert not fits(found.seq_len + 1024)
    huge = replace(H100, gpu_total_bytes=10**15)
    found = longest_sequence(cfg, adapter, huge)
    assert (found.seq_len, found.limit) == (40960, "the model's max_position_embeddings 40,960")
    config = tmp_path / "c.yaml"
    code = main(["estimate", str(config), "train.global_batch_size=1", "--longest-seq", "--json"])
    report = json.loads(capsys.readouterr().out)  # printed whether or not the run fits here
    assert "longest_seq" in report
    assert code == (0 if report["fits"] else 2)  # exit 2 where this machine cannot hold it


def test_every_rank_counts_its_own_process(tmp_path: Path, qwen3_4b: Path) -> None:
    """Each rank is a process with its own torch and CUDA runtime beside the one shared store:
    two ranks count two processes' bytes in host RAM, the store once."""
    adapter = HFAdapter.from_dir(qwen3_4b)
    base = ("data.seq_len=1024", "train.global_batch_size=16", "runtime.device=auto")
    one = estimate_run(_cfg(tmp_path, qwen3_4b, *base), adapter, H100)
    two = estimate_run(_cfg(tmp_path, qwen3_4b, *base, "runtime.gpus=2",
                            "runtime.param_route=replicated"), adapter, H100)  # fmt: skip
    assert (one.process_bytes, two.process_bytes) == (CUDA_PROCESS_BYTES, 2 * CUDA_PROCESS_BYTES)
    assert two.ram_bytes - one.ram_bytes >= CUDA_PROCESS_BYTES


def test_for_several_gpus_the_model_predicts_each_route(tmp_path: Path, qwen3_4b: Path) -> None:
    adapter = HFAdapter.from_dir(qwen3_4b)
    cfg = _cfg(tmp_path, qwen3_4b, "data.seq_len=1024", "train.global_batch_size=64",
               "runtime.gpus=4", "runtime.device=auto")  # fmt: skip
    est = estimate_run(cfg, adapter, H100)  # one GPU here: four is a prediction
    assert est.route_steps is not None
    assert set(est.route_steps) == {
        "replicated/gpu", "sharded/gpu", "replicated/cpu", "sharded/cpu"
    }  # fmt: skip
    assert est.step_model is not None
    assert est.route_steps["replicated/gpu"] == est.step_model.step_s  # this run's route
    # the cpu route copies f32 gradients from every GPU and sums them on the host
    assert est.route_steps["replicated/cpu"] > est.route_steps["replicated/gpu"]
    # each GPU computes its B/4 = 16 rows: the one-GPU run at B=16 is the same compute
    one = estimate_run(_cfg(tmp_path, qwen3_4b, "data.seq_len=1024",
                            "train.global_batch_size=16"), adapter, H100)  # fmt: skip
    assert one.route_steps is None
    assert one.step_model is not None
    assert est.step_model.busy_s["compute"] == pytest.approx(one.step_model.busy_s["compute"])
    table = format_estimate(est)
    assert "model on each route (4 GPUs, a prediction: this machine has 1)" in table
    assert "replicated/gpu (this run's)" in table


def test_without_the_mirror_the_model_casts_at_the_probed_rate(
    tmp_path: Path, qwen3_4b: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    adapter = HFAdapter.from_dir(qwen3_4b)
    cfg = _cfg(tmp_path, qwen3_4b, "data.seq_len=1024", "train.global_batch_size=16",
               "runtime.bf16_mirror=false")  # fmt: skip

    def host_busy(cast_gbps: float) -> float:
        cache_rate(update_threads(cfg, H100), H100.gpu_name, 150.0, joint_gbps=110.0,
                   cast_gbps=cast_gbps)  # fmt: skip
        model = estimate_run(cfg, adapter, H100).step_model
        assert model is not None
        return model.busy_s["host"]

    # the host thread casts every load (6 B/param): a quarter of the rate, four times the time
    assert host_busy(5.0) == pytest.approx(4 * host_busy(20.0), rel=1e-6)
