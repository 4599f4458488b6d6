"""The trials of one selection in one child process, one after another (``TrialChild``).

On one GPU every calibration and validation trial runs outside the choosing process (an OOM
must not fragment the allocator of the run that trains), but not each in a process of its own:
the interpreter, the imports, the CUDA context and the kernels compiled by the first trial
(Liger's Triton kernels, the compiled layers) are paid once per selection instead of once
per trial, and so is the host store where the trials' layouts agree (``trial_store``: a
trial's setup is mostly its store). Each trial is still ``validate.run_trial`` on a fresh
trainer, and its step time the median after the warm-up step, as before. Invariants: between
trials the child frees the trainer and empties CUDA's cache, so a trial's reserved peak is its
own; a trial that runs out of memory ends the child, and the next trial starts a fresh one (a
fragmented allocator never times a later trial); a trial past ``validate.TIMEOUT_S`` or a
failure is one ``ConfigError``.

Run by ``TrialChild``, not by hand: ``python -m slidedp.autopolicy.trial_child`` says it is
ready in one line, then reads ``CONFIG.yaml STEPS`` lines on stdin and answers each with the
trial's JSON line.

Example::

    with TrialChild() as runner:
        trial = runner(cfg, 3)
"""

from __future__ import annotations

import dataclasses
import json
import os
import select
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from types import TracebackType
from typing import IO, TYPE_CHECKING

from slidedp.autopolicy import validate
from slidedp.autopolicy.trial_store import TrialStores
from slidedp.autopolicy.validate import EXIT_BAD_INPUT, TIMEOUT_S, Runner, Trial, ran_past
from slidedp.config import load_config, resolved_yaml
from slidedp.errors import ConfigError, SlidedpError
from slidedp.runtime.lifetime import die_with_parent, worker_env
from slidedp.runtime.zygote import Child, start_child

if TYPE_CHECKING:
    from slidedp.config import TrainConfig
    from slidedp.plan.machine import Machine

CLOSE_S = 30.0  # an idle child given this long to exit once its input is closed


class TrialChild:
    """A ``Runner`` whose trials run in one child process (started at the first trial, again
    after one that ran out of memory); ``close`` ends it."""

    def __init__(self) -> None:
        self._dir = tempfile.TemporaryDirectory(prefix="slidedp-trials-")
        self._child: Child | None = None
        self._pipes: tuple[IO[bytes], IO[bytes]] | None = None  # to its stdin, from its stdout
        self._stderr: IO[bytes] | None = None
        self._said = 0  # bytes of the child's stderr passed on
        self._ready = False  # the child said it is ready (its imports done)
        self.trials = 0
        self.processes = 0  # child processes started

    def __call__(self, cfg: TrainConfig, steps: int) -> Trial:
        path = Path(self._dir.name) / f"trial-{self.trials}.yaml"
        self.trials += 1
        path.write_text(resolved_yaml(cfg))
        child, (to_child, _) = self.wait_ready(cfg)
        to_child.write(f"{path} {steps}\n".encode())
        to_child.flush()
        trial = Trial(**json.loads(self._answer(child, cfg)))
        if trial.step_s is None:  # out of memory: the child has ended
            self._stop()
        return trial

    def start(self) -> None:
        """Start the child now (its imports beside other work), unless it runs."""
        self._running()

    def wait_ready(self, cfg: TrainConfig | None = None) -> tuple[Child, tuple[IO[bytes], ...]]:
        """The child and its pipes (to its stdin, from its stdout), started if it is not, once
        its imports are done (its first line): from then on it is idle until a trial.
        ``cfg``: the trial it is for, named if the child fails first."""
        child, pipes = self._running()
        if not self._ready:
            self._answer(child, cfg)
            self._ready = True
        return child, pipes

    def _running(self) -> tuple[Child, tuple[IO[bytes], IO[bytes]]]:
        """The child (``runtime.zygote.start_child``: forked from the launcher's zygote, or a
        fresh interpreter) and its pipes."""
        if self._child is None or self._pipes is None:
            self._ready = False
            # appended to (O_APPEND): our reads never move where the child writes
            self._stderr = (Path(self._dir.name) / f"stderr-{self.processes}").open("a+b")
            self._said = 0
            its_stdin, to_child = os.pipe()
            from_child, its_stdout = os.pipe()
            self._child = start_child("slidedp.autopolicy.trial_child", [], worker_env(),
                                      stdio=(its_stdin, its_stdout, self._stderr))  # fmt: skip
            os.close(its_stdin)
            os.close(its_stdout)
            self._pipes = (os.fdopen(to_child, "wb"), os.fdopen(from_child, "rb"))
            self.processes += 1
        return self._child, self._pipes

    def _answer(self, child: Child, cfg: TrainConfig | None) -> str:
        """The child's next line, within ``TIMEOUT_S``; its stderr passed on."""
        what = "starting the trials" if cfg is None else f"validating {cfg.runtime.layout.layers}"
        assert self._pipes is not None
        from_child = self._pipes[1]
        deadline, line = time.monotonic() + TIMEOUT_S, b""
        while not line.endswith(b"\n"):
            left = max(0.0, deadline - time.monotonic())
            if not select.select([from_child], [], [], left)[0]:
                self._stop()
                if cfg is not None:
                    raise ran_past(cfg)
                raise ConfigError(f"runtime.policy=auto: {what} ran past {TIMEOUT_S:.0f} s")
            chunk = os.read(from_child.fileno(), 1 << 16)
            if not chunk:  # the child ended without an answer
                code = child.wait()
                last = (self._pass_stderr().strip().splitlines() or [f"exit code {code}"])[-1]
                self._stop()
                raise ConfigError(f"runtime.policy=auto: {what} failed: {last}")
            line += chunk
        self._pass_stderr()
        return line.decode()

    def _pass_stderr(self) -> str:
        """What the child wrote on stderr since last time, written on ours too."""
        if self._stderr is None:
            return ""
        self._stderr.seek(self._said)
        said = self._stderr.read().decode(errors="replace")
        self._said = self._stderr.tell()
        sys.stderr.write(said)
        return said

    def _stop(self) -> None:
        child, self._child = self._child, None
        pipes, self._pipes = self._pipes, None
        if child is not None and pipes is not None:
            pipes[0].close()
            if not self._ready:  # still importing: nothing of it to wait for
                child.kill()
            try:
                child.wait(timeout=CLOSE_S)
            except subprocess.TimeoutExpired:
                child.kill()
                child.wait()
            pipes[1].close()
        if self._stderr is not None:
            self._stderr.close()
            self._stderr = None

    def close(self) -> None:
        """End the child (its input closed, then killed past ``CLOSE_S``; at once while it
        imports), remove the files."""
        self._stop()
        self._dir.cleanup()

    def __enter__(self) -> TrialChild:
        return self

    def __exit__(
        self,
        kind: type[BaseException] | None,
        error: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.close()


def runner_for(machine: Machine, world: int = 1) -> Runner:
    """The trials of a selection: on one GPU in one child process (``TrialChild``; ``close`` it
    when done), on CPU in this one, on several ranks on as many processes each
    (``validate.trial_on_ranks``)."""
    if world > 1:
        return validate.trial_on_ranks
    return TrialChild() if machine.device == "cuda" else validate.run_trial


def serve() -> int:
    """The child: one trial per input line, its JSON line on the real stdout (anything else
    printed goes to stderr); ends at the end of its input or after a trial out of memory."""
    die_with_parent()  # a selection killed mid-trial leaves no trial on the GPU
    answers = os.dup(1)
    os.dup2(2, 1)
    os.write(answers, b'{"ready": true}\n')  # the imports are done
    stores = TrialStores()
    while line := sys.stdin.readline():
        config, steps = line.split()
        try:
            trial = validate.run_trial(load_config(config), int(steps), stores=stores)
        except SlidedpError as e:
            print(" ".join(str(e).split()), file=sys.stderr)
            return EXIT_BAD_INPUT
        os.write(answers, (json.dumps(dataclasses.asdict(trial)) + "\n").encode())
        if trial.step_s is None:
            return 0
    return 0


if __name__ == "__main__":
    sys.exit(serve())
