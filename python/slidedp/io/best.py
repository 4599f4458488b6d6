"""The checkpoint of the lowest evaluation loss (``output.save_best``): ``OUTPUT/best``.

``OUTPUT/best`` is one JSON line ``{"checkpoint": "checkpoint-STEP", "eval_loss": x}``,
replaced atomically (temp file, fsync, rename) once that checkpoint is complete. Checkpoint
rotation (``output.save_total_limit``, ``io.checkpoint``) never removes the checkpoint it names;
a resumed run reads it, so a later evaluation must beat the loss it records.

Example::

    best = BestCheckpoint(out)
    if best.improves(loss):
        best.mark(save(), loss)
"""

from __future__ import annotations

import json
import math
import os
from pathlib import Path

BEST = "best"


class BestCheckpoint:
    """The best checkpoint of ``out_dir`` so far, and its evaluation loss."""

    def __init__(self, out_dir: Path) -> None:
        self.out_dir = out_dir
        self.path: Path | None = None
        self.loss = math.inf
        try:
            found = json.loads((out_dir / BEST).read_text())
            path = out_dir / str(found["checkpoint"])
            if path.is_dir():
                self.path, self.loss = path, float(found["eval_loss"])
        except (OSError, ValueError, KeyError, TypeError):
            pass  # none yet, or unreadable: the next evaluation sets it

    def improves(self, loss: float) -> bool:
        return math.isfinite(loss) and loss < self.loss

    def kept(self) -> tuple[Path, ...]:
        """What checkpoint rotation must leave alone."""
        return () if self.path is None else (self.path,)

    def mark(self, checkpoint: Path, loss: float) -> None:
        """``checkpoint`` (complete, in ``out_dir``) holds the weights of eval loss ``loss``."""
        temp = self.out_dir / f".{BEST}.tmp"
        temp.write_text(json.dumps({"checkpoint": checkpoint.name, "eval_loss": loss}) + "\n")
        fd = os.open(temp, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)
        temp.replace(self.out_dir / BEST)
        self.path, self.loss = checkpoint, loss
