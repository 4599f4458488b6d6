"""Experiment trackers (``output.report_to``): TensorBoard and Weights & Biases.

Each tracker gets the resolved config and the run's plan once, then every step record of
``metrics.jsonl`` (``runtime.train_log``) and the evaluation records (``eval_*``). TensorBoard
(``OUTPUT/tensorboard``) writes each number as a scalar ``train/KEY`` (``eval/KEY``). W&B (the
``slidedp[wandb]`` extra) starts one run in ``OUTPUT/wandb`` named after ``output.dir``; the
``WANDB_*`` variables apply as W&B reads them (``WANDB_MODE=offline``: local files only).
A tracker that fails during the run is told once and left out from then on: it copies
``metrics.jsonl``, which has every step, and never costs the training.

Example::

    trackers = open_trackers(["tensorboard", "wandb"], out, config=cfg_dict, plan=plan_dict)
    trackers.log_step({"step": 1, "loss": 2.3, ...})
    trackers.close()
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any, Protocol

import yaml

from slidedp.errors import ConfigError, exception_line

TRACKERS = ("tensorboard", "wandb")
_WANDB_MODES = ("online", "offline", "shared", "disabled", "dryrun", "run")  # W&B's own list
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
    name = "tensorboard"

    def __init__(self, writer: SummaryWriterLike) -> None:
        self.writer = writer

    @classmethod
    def open(cls, out_dir: Path, start_step: int = 0) -> TensorBoardTracker:
        """The writer of ``OUTPUT/tensorboard``; a run resumed after ``start_step`` purges the
        events of later steps an earlier run wrote (its ``metrics.jsonl`` drops them too)."""
        from torch.utils.tensorboard import SummaryWriter  # noqa: PLC0415  optional: tensorboard

        writer: SummaryWriterLike = SummaryWriter(
            log_dir=str(out_dir / "tensorboard"), purge_step=start_step + 1 if start_step else None
        )
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
    if "wandb" not in names:
        return
    mode = os.environ.get("WANDB_MODE")
    if mode is not None and mode not in _WANDB_MODES:
        raise ConfigError(
            f"output.report_to has wandb but WANDB_MODE={mode!r} is not a W&B mode: set it to "
            "online, offline or disabled, or unset it"
        )
    if mode in _WANDB_LOCAL:
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


def _snapshot(folder: Path) -> dict[str, str | bytes | None]:
    """What ``folder`` holds at its top: each link's target, each file's bytes (W&B's are
    small: its debug logs are links), None for a folder."""
    if not folder.is_dir():
        return {}
    entries: dict[str, str | bytes | None] = {}
    for entry in folder.iterdir():
        if entry.is_symlink():
            entries[entry.name] = os.readlink(entry)
        else:
            entries[entry.name] = entry.read_bytes() if entry.is_file() else None
    return entries


def _restore(folder: Path, before: dict[str, str | bytes | None]) -> None:
    """``folder`` back as ``_snapshot`` saw it: what came since removed, links and files
    rewritten since put back; no folder at all when there was none."""
    if not before:
        shutil.rmtree(folder, ignore_errors=True)
        return
    for entry in folder.iterdir():
        if entry.name not in before and entry.is_dir() and not entry.is_symlink():
            shutil.rmtree(entry, ignore_errors=True)
            continue
        if entry.name not in before:
            entry.unlink(missing_ok=True)
            continue
        was = before[entry.name]
        if isinstance(was, str) and (not entry.is_symlink() or os.readlink(entry) != was):
            entry.unlink(missing_ok=True)
            entry.symlink_to(was)
        elif isinstance(was, bytes) and entry.read_bytes() != was:
            entry.write_bytes(was)


class WandbTracker:
    name = "wandb"

    def __init__(self, out_dir: Path) -> None:
        import wandb  # noqa: PLC0415  optional: the slidedp[wandb] extra, checked by the config

        runs = out_dir / "wandb"
        before = _snapshot(runs)
        try:
            self.run = wandb.init(dir=str(out_dir), name=out_dir.resolve().name)
        except wandb.errors.Error as e:  # no login, no server, ...: the run is refused
            _restore(runs, before)  # nothing of this run left behind
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
    """Every tracker of ``output.report_to``, as one. One that fails (a full disk, W&B's
    server gone) is told through ``say`` and records nothing more: the run goes on."""

    def __init__(
        self,
        trackers: Sequence[TensorBoardTracker | WandbTracker],
        say: Callable[[str], None] = print,
    ) -> None:
        self.trackers, self.say = list(trackers), say

    def log_step(self, record: dict[str, Any]) -> None:
        for tracker in list(self.trackers):
            if not self._ran(tracker, f"at step {record['step']}", tracker.log_step, record):
                with contextlib.suppress(Exception):  # closed as far as it can be
                    tracker.close()

    def close(self) -> None:
        for tracker in list(self.trackers):
            self._ran(tracker, "closing", tracker.close)

    def _ran(
        self, tracker: TensorBoardTracker | WandbTracker, when: str, call: Any, *args: Any
    ) -> bool:
        try:
            call(*args)
        except Exception as e:  # a copy of metrics.jsonl: never the end of the training
            self.trackers.remove(tracker)
            self.say(
                f"warning: {tracker.name} failed {when} ({exception_line(e)}) and records "
                "nothing more of this run; metrics.jsonl has every step"
            )
            return False
        return True


def open_trackers(
    names: Sequence[str],
    out_dir: Path,
    *,
    config: dict[str, Any],
    plan: dict[str, Any],
    start_step: int = 0,
    say: Callable[[str], None] = print,
) -> Trackers | None:
    """The trackers ``names`` names (None: none), each told the config and the plan. W&B
    opens first: refused, it leaves nothing of the others behind."""
    opened: list[TensorBoardTracker | WandbTracker] = []
    for name in sorted(dict.fromkeys(names), key=lambda name: name != "wandb"):
        tracker = WandbTracker(out_dir) if name == "wandb" else None
        opened.append(tracker or TensorBoardTracker.open(out_dir, start_step))
        opened[-1].log_run(config, plan)
    return Trackers(opened, say) if opened else None
