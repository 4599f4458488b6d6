"""The training loop behind ``slidedp train CONFIG.yaml [section.key=value ...]``.

Builds the model adapter, the host store (master weights loaded or initialised), the data and
the engine; runs ``train.max_steps`` steps, one JSON line per step in ``OUTPUT/metrics.jsonl``
and one human line on stdout; drains the update lane and exports ``OUTPUT/final/``.

Example::

    from slidedp.config import load_config
    Trainer(load_config("examples/tiny-qwen3.yaml", ["train.max_steps=5"])).run()
"""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Any, Literal

import torch

from slidedp.config import TrainConfig
from slidedp.data.jsonl import JsonlBatches, read_sequences
from slidedp.errors import ConfigError
from slidedp.io.export import export_hf
from slidedp.io.hf_load import fill_master
from slidedp.kernels import default_threads
from slidedp.models.hf import HFAdapter
from slidedp.runtime.engine import Engine, OptimConfig
from slidedp.runtime.schedule import lr_schedule
from slidedp.store import HostStore

_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}


def pick_device(name: str) -> torch.device:
    if name == "cuda" and not torch.cuda.is_available():
        raise ConfigError("runtime.device=cuda but no CUDA device is available")
    if name == "auto":
        name = "cuda" if torch.cuda.is_available() else "cpu"
    return torch.device(name)


def pick_dtype(name: str, device: torch.device) -> torch.dtype:
    if name == "auto":
        return torch.bfloat16 if device.type == "cuda" else torch.float32
    return _DTYPES[name]


class Trainer:
    def __init__(self, cfg: TrainConfig, *, log: bool = True) -> None:
        self.cfg, self.log = cfg, log
        tc, rt = cfg.train, cfg.runtime
        self.device = pick_device(rt.device)
        self.dtype = pick_dtype(tc.dtype, self.device)
        torch.manual_seed(tc.seed)
        self.adapter = HFAdapter.from_dir(cfg.model.path)
        grad_dtype: Literal["bf16", "f32"] = "bf16" if self.dtype == torch.bfloat16 else "f32"
        self.store = HostStore.create(
            self.adapter.group_specs(), staging_slots=2, grad_dtype=grad_dtype
        )
        self.source = fill_master(self.adapter, self.store, tc.seed)
        sequences = read_sequences(Path(cfg.data.path), cfg.data.seq_len, Path(cfg.model.path))
        pad_id = self.adapter.config.pad_token_id
        self.data = JsonlBatches(
            sequences,
            tc.global_batch_size,
            0 if pad_id is None else int(pad_id),
            self.adapter.vocab_size,
        )
        self.lr_at = lr_schedule(tc.lr_scheduler, tc.learning_rate, tc.warmup_steps, tc.max_steps)
        self.engine = Engine(
            self.adapter,
            self.store,
            device=self.device,
            dtype=self.dtype,
            optim=OptimConfig(
                betas=(tc.adam_beta1, tc.adam_beta2),
                eps=tc.adam_epsilon,
                weight_decay=tc.weight_decay,
                max_grad_norm=tc.max_grad_norm,
            ),
            slots=rt.slots,
            offload_ratio=rt.offload_ratio,
            loss_chunk_tokens=rt.loss_chunk_tokens,
            threads=rt.update_threads or self._default_host_threads(),
            version_timeout_s=rt.version_timeout_s,
        )
        self.out_dir = Path(cfg.output.dir)

    def _default_host_threads(self) -> int | None:
        """All cores for host kernels on GPU; on CPU, half of them (torch computes on the
        rest: two thread pools spinning on the same cores slow each step down ~10x)."""
        if self.device.type == "cuda":
            return None
        return max(1, default_threads() // 2)

    def _say(self, line: str) -> None:
        if self.log:
            print(line, flush=True)

    def run(self) -> list[dict[str, Any]]:
        """All steps; returns the metrics records (also in ``OUTPUT/metrics.jsonl``)."""
        tc = self.cfg.train
        self.out_dir.mkdir(parents=True, exist_ok=True)
        a = self.adapter
        self._say(
            f"slidedp train: {a.config.model_type}, {a.num_layers} layers, tied={a.tied}, "
            f"{self.source}; device {self.device}, {self.dtype}, "
            f"{len(self.engine.window.slots)} slots ({self.engine.window.param_bytes()} B)"
        )
        records: list[dict[str, Any]] = []
        with (self.out_dir / "metrics.jsonl").open("w") as metrics:
            for t in range(tc.max_steps):
                batch = self.data.batch(t)
                lr = self.lr_at(t)
                start = time.perf_counter()
                result = self.engine.step(t, batch, lr)
                step_time_s = time.perf_counter() - start
                record: dict[str, Any] = {
                    "step": t + 1,
                    "loss": result.loss,
                    "grad_norm": result.grad_norm,
                    "clip_coef": result.clip_coef,
                    "lr": lr,
                    "tokens": batch.tokens,
                    "label_tokens": result.label_tokens,
                    "step_time_s": round(step_time_s, 6),
                    "tokens_per_s": round(batch.tokens / step_time_s, 1),
                    **self.engine.lane_times(),
                }
                if self.device.type == "cuda":
                    record["gpu_max_allocated_bytes"] = torch.cuda.max_memory_allocated()
                records.append(record)
                metrics.write(json.dumps(record) + "\n")
                metrics.flush()
                self._say(
                    f"step {t + 1}/{tc.max_steps} | loss {result.loss:.4f} | "
                    f"grad_norm {result.grad_norm:.4f} | lr {lr:.3e} | "
                    f"{record['tokens_per_s']:.0f} tok/s | {step_time_s * 1000:.0f} ms"
                )
        self.engine.drain()
        if self.cfg.output.export:
            final = export_hf(self.adapter, self.store, self.out_dir / "final")
            self._say(f"exported {final}")
        return records


def train(cfg: TrainConfig, *, log: bool = True) -> list[dict[str, Any]]:
    return Trainer(cfg, log=log).run()
