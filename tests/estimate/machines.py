"""The machines the estimate tests plan for: the H100 host of DEVICE.md (16 cores, 120 GiB
available, 80 GB of GPU memory)."""

from __future__ import annotations

from slidedp.plan.machine import GIB, Machine

H100 = Machine(
    device="cuda",
    dtype="bfloat16",
    cores=16,
    shm_free_bytes=100 * GIB,
    mem_available_bytes=120 * GIB,
    gpu_name="NVIDIA H100 80GB HBM3",
    gpu_total_bytes=80 * 10**9,
)
