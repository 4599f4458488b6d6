"""AutoPolicy's validation stage: a few training steps of the solver's choice and of the fixed
default (all ``F``), the run's own engine and data, in a scratch output directory deleted after.

A trial's step time is the median of its steps after the first; on CUDA its peak reserved
memory must stay under the device total less ``select.HEADROOM``, else the choice is solved
again with the budget cut by the overshoot (``RESOLVES`` times at most). Invariants: the choice
runs only when validated faster; the default wins ties and whenever the choice does not fit. On
CUDA the trials run in a child process (``autopolicy.trial_child``) so an OOM cannot fragment
the training process; on several ranks (``python -m slidedp.autopolicy.validate CONFIG STEPS``
on each) the slowest rank counts.

Example::

    found = validate_choice(default_cfg, choice, resolve, steps=3, limit_bytes=None)
    print(found.describe())   # '4xN-r0, 0 GPU-resident 0.210 s/step vs the default's 0.260 s'
"""

from __future__ import annotations

import dataclasses
import gc
import json
import os
import statistics
import sys
import tempfile
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from slidedp.autopolicy.clock import break_even_steps
from slidedp.autopolicy.select import DEFAULT, HEADROOM
from slidedp.config import load_config, resolved_yaml
from slidedp.errors import (
    ConfigError,
    InvalidArgumentError,
    OutOfSharedMemoryError,
    SlidedpError,
)
from slidedp.plan.device import pick_device
from slidedp.plan.layout import format_layout
from slidedp.plan.policy import resident_text
from slidedp.runtime import launch as rank_launcher
from slidedp.runtime.dist import Dist
from slidedp.runtime.lifetime import die_with_parent
from slidedp.runtime.trainer import Trainer

if TYPE_CHECKING:
    from slidedp.autopolicy.select import Choice
    from slidedp.autopolicy.trial_store import TrialStores
    from slidedp.config import TrainConfig
    from slidedp.plan.machine import Machine

RESOLVES = 2  # re-solves after a trial that did not fit, at most
EXIT_OUT_OF_MEMORY = 3  # a rank of a trial on several ranks ran out of device memory
OOM_CUT = 0.1  # share of the budget cut after an out-of-memory failure below the limit
TIMEOUT_S = 1800.0  # a trial loads the whole model (and may compile its layer) first
EXIT_BAD_INPUT = 2
GIB = 2**30


def is_out_of_memory(error: BaseException) -> bool:
    """CUDA or host allocation failure (torch's OOM, our shared-memory shortage, a failed
    pinned allocation, the CPU allocator giving up)."""
    if isinstance(error, torch.OutOfMemoryError | MemoryError):
        return True
    text = str(error)
    return isinstance(error, RuntimeError) and (
        "out of memory" in text or "can't allocate memory" in text
    )


@dataclass(frozen=True)
class Trial:
    """One policy's validation run."""

    layout: str
    resident_layers: int
    step_s: float | None  # median of the timed steps; None: it ran out of memory
    reserved_bytes: int | None  # CUDA's peak reserved bytes (at the failure too); None on CPU
    resident_embeddings: bool = False

    def fits(self, limit_bytes: int | None) -> bool:
        over = limit_bytes is not None and (self.reserved_bytes or 0) > limit_bytes
        return self.step_s is not None and not over

    def name(self) -> str:
        return f"{self.layout}, {resident_text(self.resident_layers, self.resident_embeddings)}"


Runner = Callable[["TrainConfig", int], Trial]


def trial_config(cfg: TrainConfig, steps: int, out_dir: Path) -> TrainConfig:
    """``cfg`` for a trial of ``steps`` steps writing nothing but into ``out_dir``: a new run
    (no resume), no export, TensorBoard nor trace, the policy as given."""
    train = dataclasses.replace(cfg.train, max_steps=max(cfg.train.max_steps, steps), resume="")
    output = dataclasses.replace(cfg.output, dir=str(out_dir), export=False, tensorboard=False,
                                 save_steps=0)  # fmt: skip
    runtime = cfg.runtime.with_keys(policy="", trace_path="")
    return dataclasses.replace(cfg, train=train, output=output, runtime=runtime)


def run_trial(
    cfg: TrainConfig, steps: int, *, on_ranks: bool = False, stores: TrialStores | None = None
) -> Trial:
    """``steps`` training steps of ``cfg`` in this process (``Trainer.timed_steps``).
    ``on_ranks``: one of several ranks (``trial_on_ranks``): ``cfg`` is already the trial's,
    with the scratch directory every rank shares, and running out of device memory is raised
    (it ends this rank, and the launcher stops the others) instead of being the result.
    ``stores``: the host store held between one process's trials (``trial_store``)."""

    cuda = pick_device(cfg.runtime.launch.device).type == "cuda"
    if cuda:  # the peak of this trial alone (an earlier one's cached blocks released)
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()
    rt = cfg.runtime
    step_s = None
    with tempfile.TemporaryDirectory(prefix="slidedp-validate-") as tmp:
        trial = cfg if on_ranks else trial_config(cfg, steps, Path(tmp))
        try:  # one expression: no name keeps the trainer past the gc below
            times = (
                Trainer(trial, log=False) if stores is None else stores.trainer(trial)
            ).timed_steps(steps)
            step_s = statistics.median(times[1:])
        except Exception as e:  # only running out of device memory is a result
            if stores is not None:  # the store is mid-step
                stores.drop()
            oom = is_out_of_memory(e) and not isinstance(e, OutOfSharedMemoryError)
            if on_ranks or not oom:
                raise
    gc.collect()  # the trainer's store and window, before the next trial's
    reserved = int(torch.cuda.max_memory_reserved()) if cuda else None
    return Trial(
        rt.layout.layers, rt.layout.resident_layers, step_s, reserved, rt.layout.resident_embeddings
    )


def trial_on_ranks(cfg: TrainConfig, steps: int) -> Trial:
    """``run_trial`` on the run's ``runtime.world`` ranks, started as ``slidedp train`` starts
    them (``runtime.launch``), writing into one scratch directory: each rank says its trial,
    and the slowest rank's step and the largest reservation count (a synchronous step waits
    for the slowest; the limit holds on every GPU). A rank that runs out of device memory exits
    with ``EXIT_OUT_OF_MEMORY`` and the launcher stops the others: the trial did not fit."""

    rt = cfg.runtime
    with tempfile.TemporaryDirectory(prefix="slidedp-validate-") as tmp:
        path, out, err = Path(tmp) / "config.yaml", Path(tmp) / "stdout", Path(tmp) / "stderr"
        path.write_text(resolved_yaml(trial_config(cfg, steps, Path(tmp) / "out")))
        with out.open("wb") as stdout, err.open("wb") as stderr:
            spec = rank_launcher.LaunchSpec(
                module="slidedp.autopolicy.validate", name="policy validation",
                own_session=False, stdout=stdout, stderr=stderr, training_run=False)  # fmt: skip
            code = rank_launcher.launch(rt.launch.world, [str(path), str(steps)],
                                        timeout_s=TIMEOUT_S, spec=spec)  # fmt: skip
        printed, said = out.read_text(), err.read_text()
    if code == rank_launcher.EXIT_TIMED_OUT:
        raise ran_past(cfg)
    if code == EXIT_OUT_OF_MEMORY:
        return Trial(
            rt.layout.layers, rt.layout.resident_layers, None, None, rt.layout.resident_embeddings
        )
    sys.stderr.write(said)
    ranks = [Trial(**json.loads(line)) for line in printed.splitlines() if line.startswith("{")]
    if code != 0 or len(ranks) != rt.launch.world:
        last = (said.strip().splitlines() or [f"exit code {code}"])[-1]
        raise ConfigError(f"runtime.policy=auto: validating {rt.layout.layers} failed: {last}")
    steps_s = [t.step_s for t in ranks if t.step_s is not None]
    reserved = [t.reserved_bytes for t in ranks if t.reserved_bytes is not None]
    return dataclasses.replace(ranks[0], step_s=max(steps_s) if steps_s else None,
                               reserved_bytes=max(reserved) if reserved else None)  # fmt: skip


def ran_past(cfg: TrainConfig) -> ConfigError:
    return ConfigError(
        f"runtime.policy=auto: validating {cfg.runtime.layout.layers} ran past "
        f"{TIMEOUT_S:.0f} s; set "
        "runtime.policy_validate_steps=0 or write the policy by hand"
    )


@dataclass(frozen=True)
class Validation:
    """What validation ran and which policy won (``choice`` None: the default)."""

    steps: int  # per trial, the warm-up included
    default: Trial
    trials: tuple[Trial, ...]  # the solver's choice, then each re-solve's
    cuts_bytes: tuple[int, ...]  # the budget's cut (in all) at each re-solve
    choice: Choice | None
    limit_bytes: int | None

    @property
    def winner(self) -> Trial:
        return self.default if self.choice is None else self.trials[-1]

    def speedup(self) -> float | None:
        """The default's validated step over the winner's (None: the default runs)."""
        won, default = self.winner.step_s, self.default.step_s
        if self.choice is None or won is None or default is None:
            return None
        return default / won

    def result(self, solved: Choice) -> Choice:
        """The choice that runs: the validated one, or the fixed default in ``solved``'s place
        (its accounting kept, ``kept_default`` set)."""
        if self.choice is not None:
            return self.choice

        all_f = (DEFAULT,) * len(solved.layers)
        return dataclasses.replace(solved, layout=format_layout(all_f), layers=all_f,
                                   resident_layers=0, resident_embeddings=False,
                                   kept_default=True)  # fmt: skip

    def break_even_steps(self, selection_s: float) -> int | None:
        """Steps of the winner that pay for ``selection_s`` (None: the default runs)."""
        won, default = self.winner.step_s, self.default.step_s
        if self.choice is None or won is None or default is None:
            return None
        return break_even_steps(selection_s, default, won)

    def summary(self) -> dict[str, Any]:
        """What ran and what won, as the plan's report and the selection cache keep it."""
        return {
            "steps": self.steps,
            "default": dataclasses.asdict(self.default),
            "trials": [dataclasses.asdict(t) for t in self.trials],
            "budget_cuts_bytes": list(self.cuts_bytes),
            "limit_bytes": self.limit_bytes,
            "winner": "default" if self.choice is None else "chosen",
            "speedup": self.speedup(),
            "said": self.describe(),
        }

    def _said(self, t: Trial) -> str:
        if t.step_s is None:
            return f"{t.name()} ran out of memory"
        said = f"{t.name()} {t.step_s:.3f} s/step"
        if t.reserved_bytes is not None and self.limit_bytes is not None:
            said += f" reserving {t.reserved_bytes / GIB:.2f} of {self.limit_bytes / GIB:.2f} GiB"
        return said

    def describe(self) -> str:
        """One clause: every trial, the re-solves, and the verdict."""
        tried = "; ".join(self._said(t) for t in self.trials)
        if self.cuts_bytes:
            cuts = ", ".join(f"{c / GIB:.2f}" for c in self.cuts_bytes)
            tried += f" (re-solved {len(self.cuts_bytes)}x, the budget cut by {cuts} GiB)"
        if self.default.step_s is None:
            return f"{tried}; the default ran out of memory"
        verdict = "the default runs" if self.choice is None else f"{self.speedup():.2f}x faster"
        return f"{tried} vs the default's {self.default.step_s:.3f} s: {verdict}"


def _overshoot(trial: Trial, limit_bytes: int | None, budget_bytes: int) -> int:
    """Bytes to take off the budget after ``trial`` (0: it fits): what it reserved beyond
    the limit, or after an out-of-memory failure below it ``OOM_CUT`` of the budget."""
    if trial.fits(limit_bytes):
        return 0
    reserved = trial.reserved_bytes
    if limit_bytes is not None and reserved is not None and reserved > limit_bytes:
        return reserved - limit_bytes
    return max(1, int(OOM_CUT * budget_bytes))


def default_config(cfg: TrainConfig) -> TrainConfig:
    """``cfg`` on the fixed default: every layer ``F`` without offload, none GPU-resident."""
    runtime = cfg.runtime.with_keys(layers="F", offload_ratio=0.0, policy="",
                                  resident_layers=0, resident_embeddings=False)  # fmt: skip
    return dataclasses.replace(cfg, runtime=runtime)


def limit_bytes(machine: Machine) -> int | None:
    """What a validated policy may reserve on the device: its total less ``HEADROOM`` (None
    on CPU: nothing to check)."""

    if machine.device != "cuda" or machine.gpu_total_bytes is None:
        return None
    return int(machine.gpu_total_bytes * (1.0 - HEADROOM))


def _is_default(choice: Choice) -> bool:
    resident = choice.resident_layers or choice.resident_embeddings
    return not resident and all(str(p) == "F-r0" for p in choice.layers)


def with_choice(cfg: TrainConfig, choice: Choice) -> TrainConfig:
    """``cfg`` running ``choice``: its layout and what stays GPU-resident."""
    runtime = cfg.runtime.with_keys(layers=choice.layout,
                                  resident_layers=choice.resident_layers,
                                  resident_embeddings=choice.resident_embeddings)  # fmt: skip
    return dataclasses.replace(cfg, runtime=runtime)


def needs_validation(choice: Choice) -> bool:
    """A choice other than the default (the default alone has nothing to be compared with)."""
    return not _is_default(choice)


def validate_choice(
    default_cfg: TrainConfig,
    choice: Choice,
    resolve: Callable[[int], Choice],
    *,
    steps: int,
    limit_bytes: int | None,
    runner: Runner,
    configure: Callable[[TrainConfig, Choice], TrainConfig] = with_choice,
) -> Validation:
    """The default and ``choice`` validated by ``runner`` (``steps`` steps each); a choice that
    does not fit ``limit_bytes`` re-solved by ``resolve(budget cut in bytes)``, ``RESOLVES``
    times at most. ``configure``: the config a choice runs with (on several ranks, its routes
    too). Raises ``ConfigError`` when nothing fits, the default included."""
    trials, cuts = [runner(configure(default_cfg, choice), steps)], list[int]()
    first_budget = choice.budget_bytes
    while not trials[-1].fits(limit_bytes) and len(cuts) < RESOLVES:
        cut = (cuts[-1] if cuts else 0) + _overshoot(trials[-1], limit_bytes, first_budget)
        if cut >= first_budget:
            break
        try:
            choice = resolve(cut)
        except InvalidArgumentError:  # no layout fits the cut budget
            break
        cuts.append(cut)
        if _is_default(choice):  # (on several ranks its routes may differ: not worth a trial)
            break
        trials.append(runner(configure(default_cfg, choice), steps))
    # last: where trials share a process (CPU), its one-time costs count against the choice
    default = runner(default_cfg, steps)
    last = trials[-1]
    won = last.fits(limit_bytes) and (
        default.step_s is None or (last.step_s is not None and last.step_s < default.step_s)
    )
    found = Validation(steps, default, tuple(trials), tuple(cuts), choice if won else None,
                       limit_bytes)  # fmt: skip
    if not won and default.step_s is None:
        raise ConfigError(
            f"runtime.policy=auto: no layout fit the device in validation ({found.describe()}): "
            "lower train.global_batch_size or data.seq_len"
        )
    return found


def main(argv: list[str]) -> int:

    die_with_parent()  # a run killed while validating leaves no trial on the GPU
    config, steps = argv
    rank = Dist.from_env()
    try:
        trial = run_trial(load_config(config), int(steps), on_ranks=rank is not None)
    except SlidedpError as e:
        print(" ".join(str(e).split()), file=sys.stderr)
        return EXIT_BAD_INPUT
    except Exception as e:
        if rank is None or not is_out_of_memory(e) or isinstance(e, OutOfSharedMemoryError):
            raise
        print(" ".join(str(e).split()), file=sys.stderr)
        return EXIT_OUT_OF_MEMORY
    say_trial(trial)
    return 0


def say_trial(trial: Trial) -> None:
    """A rank's trial as one JSON line on stdout (``trial_on_ranks`` reads them): one write of
    the whole line, since every rank writes to the same file and ``print`` may write the text
    and its newline apart (two ranks' lines were seen run together)."""
    sys.stdout.flush()
    os.write(sys.stdout.fileno(), (json.dumps(dataclasses.asdict(trial)) + "\n").encode())


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
