"""Experiment trackers (``output.report_to``): TensorBoard and Weights & Biases.

Each tracker gets the resolved config and the run's plan once, then every step record of
``metrics.jsonl`` (``runtime.train_log``) and the evaluation records (``eval_*``). TensorBoard
(``OUTPUT/tensorboard``) writes each number as a scalar ``train/KEY`` (``eval/KEY``). W&B (the
``slidedp[wandb]`` extra) starts one run in ``OUTPUT/wandb`` named after ``output.dir``; the
``WANDB_*`` variables apply as W&B reads them (``WANDB_MODE=offline``: local files only).

Example::

    trackers = open_trackers(["tensorboard", "wandb"], out, config=cfg_dict, plan=plan_dict)
    trackers.log_step({"step": 1, "loss": 2.3, ...})
    trackers.close()
"""

from __future__ import annotations

import json
import os
import shutil
from collections.abc import Sequence
from pathlib import Path
from typing import Any, Protocol

import yaml

from slidedp.errors import ConfigError, exception_line

TRACKERS = ("tensorboard", "wandb")
_WANDB_LOCAL = ("offline", "dryrun", "disabled")  # WANDB_MODE values that need no login
_WANDB_LOGIN = "run `wandb login` or set WANDB_API_KEY"


class SummaryWriterLike(Protocol):
    """What we use of ``torch.utils.tensorboard.SummaryWriter``."""

    def add_scalar(self, tag: str, scalar_value: float, global_step: int) -> None: ...

    def add_text(self, tag: str, text_string: str, global_step: int | None = None) -> None: ...

    def close(self) -> None: ...


def _numbers(record: dict[str, Any]) -> dict[str, float]:
    """The numeric entries of a record (bools, strings and nulls left out)."""
    return {
        k: v for k, v in record.items() if isinstance(v, int | float) and not isinstance(v, bool)
    }


class TensorBoardTracker:
    def __init__(self, writer: SummaryWriterLike) -> None:
        self.writer = writer

    @classmethod
    def open(cls, out_dir: Path) -> TensorBoardTracker:
        from torch.utils.tensorboard import SummaryWriter  # noqa: PLC0415  optional: tensorboard

        writer: SummaryWriterLike = SummaryWriter(log_dir=str(out_dir / "tensorboard"))
        return cls(writer)

    def log_run(self, config: dict[str, Any], plan: dict[str, Any]) -> None:
        def block(text: str) -> str:  # TensorBoard renders markdown: indented = verbatim
            return "\n".join("    " + line for line in text.splitlines())

        self.writer.add_text("config", block(yaml.safe_dump(config, sort_keys=False)), 0)
        self.writer.add_text("plan", block(json.dumps(plan, indent=2, default=str)), 0)

    def log_step(self, record: dict[str, Any]) -> None:
        step = int(record["step"])
        for key, value in _numbers(record).items():
            if key != "step":
                tag = f"eval/{key.removeprefix('eval_')}" if key.startswith("eval_") else key
                self.writer.add_scalar(tag if "/" in tag else f"train/{tag}", value, step)

    def close(self) -> None:
        self.writer.close()


def check_trackers(names: Sequence[str]) -> None:
    """What ``slidedp validate`` and ``train`` check of the trackers before anything is
    written: W&B, unless it records locally (``WANDB_MODE``), has an API key (its server is
    reached when the run opens it)."""
    if "wandb" not in names or os.environ.get("WANDB_MODE", "").lower() in _WANDB_LOCAL:
        return
    import wandb  # noqa: PLC0415  optional: the slidedp[wandb] extra, checked by the config

    try:
        logged_in = wandb.login(verify=False, prompt=False)
    except TypeError:  # a W&B without login(prompt=): the key is checked when the run opens it
        return
    except wandb.errors.Error as e:  # a key of the wrong form
        raise ConfigError(f"output.report_to has wandb: {exception_line(e)}") from None
    if not logged_in:
        raise ConfigError(
            f"output.report_to has wandb but W&B has no API key: {_WANDB_LOGIN}, or set "
            "WANDB_MODE=offline, or take wandb out of output.report_to"
        )


class WandbTracker:
    def __init__(self, out_dir: Path) -> None:
        import wandb  # noqa: PLC0415  optional: the slidedp[wandb] extra, checked by the config

        runs = out_dir / "wandb"
        existed = runs.exists()
        try:
            self.run = wandb.init(dir=str(out_dir), name=out_dir.resolve().name)
        except wandb.errors.Error as e:  # no login, no server, ...: the run is refused
            if not existed:  # nothing of this run left behind
                shutil.rmtree(runs, ignore_errors=True)
            login = isinstance(e, wandb.errors.UsageError | wandb.errors.AuthenticationError)
            fix = _WANDB_LOGIN if login else "check the network or WANDB_BASE_URL"
            raise ConfigError(
                f"output.report_to has wandb but W&B did not start ({exception_line(e)}): "
                f"{fix}; WANDB_MODE=offline records locally only, or take wandb out of "
                "output.report_to"
            ) from None

    def log_run(self, config: dict[str, Any], plan: dict[str, Any]) -> None:
        plain = json.loads(json.dumps({"config": config, "plan": plan}, default=str))
        self.run.config.update(plain)  # type: ignore[no-untyped-call]

    def log_step(self, record: dict[str, Any]) -> None:
        self.run.log(_numbers(record), step=int(record["step"]))

    def close(self) -> None:
        self.run.finish()


class Trackers:
    """Every tracker of ``output.report_to``, as one."""

    def __init__(self, trackers: Sequence[TensorBoardTracker | WandbTracker]) -> None:
        self.trackers = list(trackers)

    def log_step(self, record: dict[str, Any]) -> None:
        for tracker in self.trackers:
            tracker.log_step(record)

    def close(self) -> None:
        for tracker in self.trackers:
            tracker.close()


def open_trackers(
    names: Sequence[str], out_dir: Path, *, config: dict[str, Any], plan: dict[str, Any]
) -> Trackers | None:
    """The trackers ``names`` names (None: none), each told the config and the plan."""
    opened: list[TensorBoardTracker | WandbTracker] = []
    for name in dict.fromkeys(names):
        tracker = TensorBoardTracker.open(out_dir) if name == "tensorboard" else None
        opened.append(tracker or WandbTracker(out_dir))
        opened[-1].log_run(config, plan)
    return Trackers(opened) if opened else None
