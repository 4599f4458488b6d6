"""The shared-memory host store: zero-copy torch views, cross-process attach, versions, cleanup."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import threading
import time

import pytest
import torch

from slidedp import errors
from slidedp.store import GroupSpec, HostStore, ParamSpec

SHM = "/dev/shm"


def _groups(layers: int = 3, width: int = 64) -> list[GroupSpec]:
    return [
        GroupSpec(
            f"layers.{i}",
            [ParamSpec(f"layers.{i}.w", (width, 33)), ParamSpec(f"layers.{i}.norm", (33,), "f32")],
        )
        for i in range(layers)
    ]


def _python(code: str) -> subprocess.Popen[str]:
    return subprocess.Popen(
        [sys.executable, "-c", textwrap.dedent(code)],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )


def test_torch_views_are_the_mapping_itself() -> None:
    store = HostStore.create(_groups(), staging_slots=2)
    master = store.region("master")
    address, nbytes = store._native.region("master")
    assert master.data_ptr() == address
    assert master.numel() * 4 == nbytes
    assert store.address <= address < store.address + store.total_bytes
    w = store.master("layers.1.w")
    assert w.shape == (64, 33)
    offset = store.layout.params[2].state_offset
    assert w.data_ptr() == address + 4 * offset
    assert w.data_ptr() % 64 == 0
    w.fill_(3.0)
    assert store.group_state(1, "master")[: 64 * 33].eq(3.0).all()
    slot = store.staging_slot(1)
    assert slot.dtype == torch.bfloat16
    assert slot.numel() == store.layout.slot_len
    with pytest.raises(errors.UnknownParameterError, match="nope"):
        store.master("nope")


def test_gradient_and_staging_slots_are_chunk_sized_not_model_sized() -> None:
    store = HostStore.create(
        _groups(2), staging_slots=1, grad_dtype="bf16", grad_slots=3, chunk_elems=1000
    )
    grad = store.region("grad")
    assert grad.dtype == torch.bfloat16
    assert store.layout.slot_len == 1024  # rounded up to a 64-byte line of bf16
    assert grad.numel() == 3 * 1024 < store.region("master").numel()
    assert store.grad_slot(2).numel() == 1024
    assert store.grad_slot(2).data_ptr() == grad.data_ptr() + 2 * 1024 * 2
    with pytest.raises(IndexError):
        store.grad_slot(3)
    whole = HostStore.create(_groups(2), staging_slots=1)
    assert whole.region("grad").numel() == 0
    biggest = max(max(g.slot_len, g.state_len) for g in whole.layout.groups)
    assert whole.layout.slot_len == biggest, "default: the largest group fits one slot"


def test_the_bf16_mirror_holds_every_group_in_slot_layout_back_to_back() -> None:
    plain = HostStore.create(_groups(3), staging_slots=1)
    assert not plain.has_mirror
    assert plain.region("mirror").numel() == 0
    store = HostStore.create(_groups(3), staging_slots=0, bf16_mirror=True)
    groups = store.layout.groups
    assert store.region("mirror").dtype == torch.bfloat16
    assert store.region("mirror").numel() == sum(g.slot_len for g in groups)
    assert [g.mirror_offset for g in groups] == [
        0,
        groups[0].slot_len,
        2 * groups[0].slot_len,
    ]
    assert (
        store.mirror_group(2).data_ptr()
        == store.region("mirror").data_ptr() + 4 * groups[0].slot_len
    )
    planned = HostStore.plan(_groups(3), staging_slots=0, bf16_mirror=True)
    assert planned.regions.total_bytes == store.total_bytes


def test_views_keep_the_mapping_alive() -> None:
    view = HostStore.create(_groups(1), staging_slots=1).master("layers.0.norm")
    view.fill_(2.0)  # the store object is gone; the view must still point at live memory
    assert view.sum().item() == 66.0


def test_a_second_process_attaches_sees_writes_and_waits_for_versions() -> None:
    store = HostStore.create(_groups(), staging_slots=1)
    store.master("layers.2.norm").copy_(torch.arange(33.0))
    child = _python(
        f"""
        from slidedp.store import HostStore
        store = HostStore.attach({store.name!r})
        print(int(store.master("layers.2.norm").sum().item()), flush=True)
        store.master("layers.0.w").fill_(-1.0)
        store.publish(0, 1)
        print(store.wait_version(2, 5, timeout_s=20), flush=True)
        """
    )
    assert child.stdout is not None
    assert child.stdout.readline().strip() == str(sum(range(33)))
    assert store.wait_version(0, 1, timeout_s=20) == 1
    assert store.master("layers.0.w").eq(-1.0).all()
    store.publish(2, 5)
    out, err = child.communicate(timeout=20)
    assert child.returncode == 0, err
    assert out.strip() == "5"


def test_a_store_of_several_parts_is_one_array_in_another_process() -> None:
    store = HostStore.create([GroupSpec("g", [ParamSpec("w", (3 * 2**20,))])], 0, parts=5)
    fds = store.name.split("-")[2].split(".")
    assert len(fds) == 5, store.name
    master = store.master("w")
    assert master.eq(0).all()
    master.copy_(torch.arange(master.numel(), dtype=torch.float32))  # spans every part
    child = _python(
        f"""
        import torch
        from slidedp.store import HostStore
        w = HostStore.attach({store.name!r}).master("w")
        print(bool(w.eq(torch.arange(w.numel(), dtype=torch.float32)).all()), flush=True)
        """
    )
    out, err = child.communicate(timeout=60)
    assert child.returncode == 0, err
    assert out.strip() == "True"


def test_nothing_is_left_in_shm_after_every_user_is_killed() -> None:
    size_mib = 96
    before_free = os.statvfs(SHM).f_bavail * os.statvfs(SHM).f_frsize
    creator = _python(
        f"""
        import sys
        from slidedp.store import GroupSpec, HostStore, ParamSpec
        g = [GroupSpec("g", [ParamSpec("w", ({size_mib} * 2**18 // 3,))])]
        store = HostStore.create(g, staging_slots=0)
        store.master("w").fill_(1.0)
        print(store.name, flush=True)
        sys.stdin.read()
        """
    )
    assert creator.stdout is not None
    name = creator.stdout.readline().strip()
    assert name.startswith("slidedp-"), creator.stderr.read() if creator.stderr else ""
    attacher = _python(
        f"""
        import sys
        from slidedp.store import HostStore
        store = HostStore.attach({name!r})
        print(int(store.master("w")[:10].sum().item()), flush=True)
        sys.stdin.read()
        """
    )
    ours = tuple(f"slidedp-{p.pid}-" for p in (creator, attacher))
    try:
        assert attacher.stdout is not None
        assert attacher.stdout.readline().strip() == "10"
        # the blocks of the store's own files (their descriptors are in its name: slidedp-PID-
        # FD[.FD...]-NONCE): the file system's free bytes also move with parallel workers' stores
        fds = name.split("-")[2].split(".")
        used = sum(os.stat(f"/proc/{creator.pid}/fd/{fd}").st_blocks * 512 for fd in fds)
        assert used >= size_mib * 2**20 * 0.9, "the store is accounted to the shm file system"
    finally:  # killed however the checks end: a live child outlives its test otherwise
        for proc in (creator, attacher):
            proc.send_signal(signal.SIGKILL)
            proc.communicate(timeout=10)
    for proc in (creator, attacher):
        assert proc.returncode == -signal.SIGKILL
    # no segment of theirs is left (other tests' stores, in parallel workers, come and go)
    assert not [e for e in os.listdir(SHM) if e.startswith(ours)]
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:
        freed = os.statvfs(SHM).f_bavail * os.statvfs(SHM).f_frsize
        if before_free - freed < 8 * 2**20:
            break
        time.sleep(0.05)
    assert before_free - freed < 8 * 2**20, "the killed store's memory was not released"


def test_too_large_a_store_names_both_byte_counts() -> None:
    with pytest.raises(errors.OutOfSharedMemoryError) as info:
        HostStore.create([GroupSpec("g", [ParamSpec("w", (2**20, 2**20))])], staging_slots=1)
    e = info.value
    assert isinstance(e, MemoryError)
    assert e.needed_bytes > e.available_bytes
    assert str(e.needed_bytes) in str(e)
    assert str(e.available_bytes) in str(e)


def test_version_wait_timeouts_and_bad_layers_are_typed() -> None:
    store = HostStore.create(_groups(2), staging_slots=1)
    with pytest.raises(errors.VersionTimeoutError) as info:
        store.wait_version(1, 3, timeout_s=0.05)
    assert (info.value.layer, info.value.expected, info.value.got) == (1, 3, 0)
    assert isinstance(info.value, TimeoutError)
    with pytest.raises(errors.LayerOutOfRangeError):
        store.publish(2, 1)
    with pytest.raises(errors.StoreAttachError):
        HostStore.attach("slidedp-1-2")
    with pytest.raises(errors.InvalidLayoutError):
        HostStore.create([GroupSpec("g", [ParamSpec("w", (3, 0))])], staging_slots=1)


def test_waiting_releases_the_gil_and_poison_wakes_waiters() -> None:
    store = HostStore.create(_groups(2), staging_slots=1)
    results: dict[str, object] = {}

    def wait(layer: int) -> None:
        try:
            results[f"layer{layer}"] = store.wait_version(layer, 1, timeout_s=20)
        except errors.SlidedpError as e:
            results[f"layer{layer}"] = e

    waiters = [threading.Thread(target=wait, args=(i,)) for i in (0, 1)]
    for t in waiters:
        t.start()
    time.sleep(0.1)  # both threads are now blocked inside Rust; this thread still runs Python
    store.publish(0, 1)
    waiters[0].join(timeout=5)
    assert results["layer0"] == 1
    store.poison()
    waiters[1].join(timeout=5)
    assert isinstance(results["layer1"], errors.StorePoisonedError)
