"""The checkpoint of the lowest evaluation loss (``output.save_best``): ``OUTPUT/best``.

``OUTPUT/best`` is one JSON line ``{"checkpoint": "checkpoint-STEP", "eval_loss": x,
"held_out": FILE}`` (FILE resolved; "" for a share of the training data), replaced atomically
(temp file, fsync, rename) once that checkpoint is complete. Checkpoint rotation
(``output.save_total_limit``, ``io.checkpoint``) never removes the checkpoint it names; a
resumed run reads it, so a later evaluation must beat the loss it records, unless it was
measured on other held-out data (``changed`` says so; the next evaluation then replaces it).

Example::

    best = BestCheckpoint(out)
    if best.improves(loss):
        best.mark(save(), loss, Retention(total_limit=2, keep=best.kept()))
"""

from __future__ import annotations

import json
import math
import os
from dataclasses import replace
from pathlib import Path

from slidedp.io.checkpoint import Retention, rotate_checkpoints

BEST = "best"


def _held_out(eval_path: str) -> str:
    return str(Path(eval_path).expanduser().resolve()) if eval_path else ""


class BestCheckpoint:
    """The best checkpoint of ``out_dir`` so far, and its evaluation loss, for a run that
    evaluates ``eval_path`` (``data.eval_path``; "": a share of the training data)."""

    def __init__(self, out_dir: Path, eval_path: str = "") -> None:
        self.out_dir, self.held_out = out_dir, _held_out(eval_path)
        self.path: Path | None = None
        self.loss = math.inf
        self.changed: str | None = None  # the line saying the best was of other held-out data
        try:
            found = json.loads((out_dir / BEST).read_text())
            path = out_dir / str(found["checkpoint"])
            if path.is_dir():
                self.path, self.loss = path, float(found["eval_loss"])
            measured = found.get("held_out", self.held_out)  # older records: not compared
            if self.path is not None and measured != self.held_out:
                self.changed = (
                    f"{out_dir / BEST} names {path.name} (eval loss {self.loss:.6g} on "
                    f"{measured or 'a share of the training data'}); this run evaluates "
                    f"{self.held_out or 'a share of the training data'}: its losses are not "
                    "compared with that one, the first becomes the best"
                )
                self.loss = math.inf  # kept from rotation until another is marked
        except (OSError, ValueError, KeyError, TypeError):
            pass  # none yet, or unreadable: the next evaluation sets it

    def improves(self, loss: float) -> bool:
        return math.isfinite(loss) and loss < self.loss

    def kept(self) -> tuple[Path, ...]:
        """What checkpoint rotation must leave alone."""
        return () if self.path is None else (self.path,)

    def mark(self, checkpoint: Path, loss: float, retention: Retention) -> None:
        """``checkpoint`` (complete, in ``out_dir``) holds the weights of eval loss ``loss``;
        the best before it is then rotated as ``retention`` says (kept until this one is
        marked: a crash between leaves a best on disk)."""
        temp = self.out_dir / f".{BEST}.tmp"
        record = {"checkpoint": checkpoint.name, "eval_loss": loss, "held_out": self.held_out}
        temp.write_text(json.dumps(record) + "\n")
        fd = os.open(temp, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)
        temp.replace(self.out_dir / BEST)
        self.path, self.loss = checkpoint, loss
        rotate_checkpoints(self.out_dir, replace(retention, keep=self.kept()), newest=checkpoint)
