"""The decoder layers' GPU kernels compiled while the host builds the store.

A run's first step compiles the kernels its layers launch (Liger's Triton kernels,
``torch.compile``'s graph) unless Triton's and Inductor's caches on disk hold them already:
6.8 s of Qwen3-4B's first step at B=4 on an H200 with fresh caches. The warm-up runs one
forward and backward of each layer kind at the run's batch and sequence with its layer
compute (``profile.layer.warm_kernels``) on a thread of each rank's own process (``KernelWarmup``)
while its node's store is created and filled (the other ranks wait for it meanwhile); ``finish``
waits for it and returns its GPU memory to the device before the engine allocates, so the
first step finds its kernels compiled and loaded. CUDA only, and only where something
compiles (``warmup_spec``). A failed warm-up costs only the time it would have saved: the
first step compiles what it needs, and ``finish`` says why in one line.

Example::

    with KernelWarmup(warmup_spec(cfg, adapter, device)) as warmup:  # started
        ...  # the store created and filled
        note = warmup.finish()  # None, or the line the banner adds
"""

from __future__ import annotations

import dataclasses
import threading
import time

import torch

from slidedp.config import TrainConfig
from slidedp.models.fast import resolve_compute
from slidedp.models.hf import HFAdapter
from slidedp.profile.layer import ProfileSpec, profile_spec, spec_config, warm_kernels


def warmup_spec(cfg: TrainConfig, adapter: HFAdapter, device: torch.device) -> ProfileSpec | None:
    """The layer run that warms ``cfg``'s kernels on ``device`` (the run's model, one rank's
    rows and sequence, its layer compute), or None: off (``runtime.kernel_warmup``), not on
    CUDA, or layers of eager kernels that nothing compiles."""
    layout = cfg.runtime.layout
    if not cfg.runtime.launch.kernel_warmup or device.type != "cuda":
        return None
    compute = resolve_compute(
        layout.kernels, layout.compile, device, adapter, layout.mlp_tile_tokens
    )
    if compute.kernels == "eager" and not compute.compile:
        return None
    return profile_spec(cfg, device=str(device), layer_kernels=compute.kernels,
                        layer_compile=bool(compute.compile))  # fmt: skip


class KernelWarmup:
    """The thread warming ``spec``'s layer kernels, started now (None: nothing to wait for).
    As a context manager it is finished on leaving (a build that failed waits for it before
    its error goes on: no thread left computing on the GPU behind it)."""

    def __init__(self, spec: ProfileSpec | None) -> None:
        self._error = ""
        self.ran_s: float | None = None  # how long the warm-up took on its thread (finished)
        self._thread: threading.Thread | None = None
        if spec is not None and spec.device == "cuda":  # a thread's current device is its own
            current = torch.cuda.current_device() if torch.cuda.is_initialized() else 0  # type: ignore[no-untyped-call]
            spec = dataclasses.replace(spec, device=f"cuda:{current}")
        self._spec = spec
        if spec is None:
            return
        try:
            # its model built here, before the thread: transformers sets torch's process-wide
            # default dtype (the config's) while it builds one, which the store's init beside
            # the thread would read (Qwen3.5-MoE draws its A_log in it)
            adapter = HFAdapter(spec_config(spec))
        except Exception as e:  # said by finish, as a failure on the thread is
            self._error = _one_line(e)
            return
        self._thread = threading.Thread(target=self._run, args=(spec, adapter),
                                        name="slidedp-kernel-warmup", daemon=True)  # fmt: skip
        self._thread.start()

    def _run(self, spec: ProfileSpec, adapter: HFAdapter) -> None:
        started = time.perf_counter()
        try:
            device = torch.device(spec.device)
            if device.type == "cuda":
                torch.cuda.set_device(device)  # this thread's current device: the run's
            warm_kernels(spec, adapter)
        except Exception as e:  # said by finish: the first step compiles instead
            self._error = _one_line(e)
        self.ran_s = time.perf_counter() - started

    def __enter__(self) -> KernelWarmup:
        return self

    def __exit__(self, *_: object) -> None:
        self.finish()

    def finish(self) -> str | None:
        """Waits for the warm-up and frees its cached GPU memory: None when it ran or none was
        started, else the line saying why the first step compiles the kernels."""
        if self._thread is not None:
            self._thread.join()
            self._thread = None
            if self._spec is not None and self._spec.device.startswith("cuda"):
                torch.cuda.empty_cache()  # its activations: the engine sizes its window next
                # the peaks the run reports are the run's own, not the warm-up's layer
                torch.cuda.reset_peak_memory_stats(self._spec.device)
        if not self._error:
            return None
        return f"the kernel warm-up failed ({self._error}): the first step compiles its kernels"


def _one_line(error: Exception) -> str:
    return " ".join(f"{type(error).__name__}: {error}".split())
