"""AutoPolicy's calibration stage, between the first solve and the final one: the candidates'
layer times measured in a reduced real pipeline, where their copies share the links.

The first solution's candidates (other than ``F-r0``, at most ``SHORTLIST``) run in the run's
model cut to ``REDUCED_LAYERS`` layers: ``T_0`` all ``F-r0`` (before and after, averaged),
``T_j`` with ``k_j`` layers on candidate ``j``, then ``τ_j = τ_0 + (T_j - T_0) / k_j``, and the
program is solved again (``select_layout(times_s=...)``). Invariants: a candidate moves off its
profiled time only where ``|T_j - T_0|`` exceeds the two defaults' spread; one that runs out of
memory keeps it; trials use the selection's runner (``autopolicy.trial_child``); only one-kind
models calibrate.

Example::

    found = calibrate_choice(default_cfg, choice, steps=3, runner=run_trial)
    choice = select_layout(..., times_s=found.times_s())
"""

from __future__ import annotations

import dataclasses
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from slidedp.autopolicy.select import DEFAULT
from slidedp.autopolicy.validate import Runner, default_config
from slidedp.models.shapes import cut_layers, resolve_shape
from slidedp.plan.layout import LayerPolicy, format_layout, parse_entry, place

if TYPE_CHECKING:
    from slidedp.autopolicy.program import Candidate
    from slidedp.autopolicy.select import Choice
    from slidedp.config import TrainConfig

SHORTLIST = 3  # candidates calibrated at most (each costs a trial)
REDUCED_LAYERS = 4  # the reduced model's decoder layers (K), at most the model's own
_WEIGHTS = ("model.safetensors.index.json",)  # with every *.safetensors: left out


def calibrated_time_s(
    default_time_s: float, default_step_s: float, step_s: float, replaced: int
) -> float:
    """``τ_j = τ_0 + (T_j - T_0) / k_j``: the profile's default layer time plus what each of
    the ``replaced`` layers added to the reduced model's step. Never below zero (a short
    trial's noise could take a candidate there; the program's times are not negative)."""
    return max(0.0, default_time_s + (step_s - default_step_s) / replaced)


def _policy(candidate: Candidate) -> LayerPolicy:
    return parse_entry(candidate.name, 0.0)[1]


def shortlist(choice: Choice) -> list[LayerPolicy]:
    """The candidates the solver's solution uses, the default left out, most layers first,
    ``SHORTLIST`` at most."""

    counts = zip(choice.problem.candidates, choice.solution.counts, strict=True)
    used = sorted(((n, _policy(c)) for c, n in counts if n > 0),
                  key=lambda np: -np[0])  # fmt: skip
    return [p for _, p in used if p != DEFAULT][:SHORTLIST]


def why_not_calibrated(steps: int, choice: Choice) -> str | None:
    """Why the choice is not calibrated (None: it is), for a run that can run trials."""
    if not steps:
        return "runtime.policy_calibrate_steps=0"
    if choice.problem.kinds:
        return "layers of several kinds"
    if not shortlist(choice):
        return "the solver chose only the default: nothing to calibrate"
    return None


def reduced_model(model_dir: Path, layers: int, out: Path) -> Path:
    """``out``: the model of ``model_dir`` cut to its first ``layers`` decoder layers (the
    bench's ``cut_layers``; of a multimodal model, its text model), without weights (the
    trainer initialises them from the config), its other files (the tokenizer) linked."""

    config = resolve_shape(str(model_dir))
    cut_layers(config.get_text_config(), layers)  # the text config is config's own object
    out.mkdir(parents=True, exist_ok=True)
    config.to_json_file(str(out / "config.json"))
    for f in model_dir.iterdir():
        if f.name != "config.json" and f.suffix != ".safetensors" and f.name not in _WEIGHTS:
            (out / f.name).symlink_to(f.resolve())
    return out


@dataclass(frozen=True)
class Calibrated:
    """One shortlisted candidate's calibration."""

    policy: LayerPolicy
    profiled_s: float  # τ_j, the profile's
    step_s: float | None  # T_j; None: out of memory
    time_s: float | None  # τ_j calibrated; None: the profiled one is kept

    def describe(self, spread_known: bool = True) -> str:
        if self.step_s is None:
            return f"{self.policy} ran out of memory (τ {self.profiled_s:.3f} s kept)"
        if self.time_s is None:
            why = ", within the default's spread" if spread_known else ""
            return f"{self.policy} step {self.step_s:.3f} s{why} (τ {self.profiled_s:.3f} s kept)"
        return f"{self.policy} τ {self.profiled_s:.3f} → {self.time_s:.3f} s"


@dataclass(frozen=True)
class Calibration:
    """What the calibration ran (``K`` layers, ``k_j`` replaced) and the times it found."""

    steps: int  # per trial, the warm-up included
    layers: int  # K
    replaced: int  # k_j
    default_time_s: float  # τ_0, the profile's
    default_step_s: float | None  # T_0, the mean of its two runs; None: out of memory
    # |T_0 before - T_0 after|: a smaller |T_j - T_0| keeps τ_j; None: the second run out of
    # memory, no spread to tell noise by (every τ kept)
    default_spread_s: float | None
    candidates: tuple[Calibrated, ...]

    def times_s(self) -> dict[LayerPolicy, float]:
        """The calibrated layer times, for ``select_layout`` (the others keep the profile's)."""
        return {c.policy: c.time_s for c in self.candidates if c.time_s is not None}

    def describe(self) -> str:
        if self.default_step_s is None:
            return (
                f"on a {self.layers}-layer model the default ran out of memory: the profiled "
                "times kept"
            )
        n = len(self.candidates)
        head = f"{n} candidate{'s' if n > 1 else ''} on a {self.layers}-layer model"
        said = ", ".join(c.describe(self.default_spread_s is not None) for c in self.candidates)
        spread = (
            " s, its second run out of memory: every τ kept"
            if self.default_spread_s is None
            else f" ± {self.default_spread_s / 2:.3f} s"
        )
        return (
            f"{head}: {said} ({self.replaced} of {self.layers} layers replaced; the default's "
            f"step {self.default_step_s:.3f}{spread}, τ {self.default_time_s:.3f} s)"
        )

    def summary(self) -> dict[str, Any]:
        """What ran and what it found, as the plan's report keeps it."""
        candidates = [dataclasses.asdict(c) | {"policy": str(c.policy)} for c in self.candidates]
        return dataclasses.asdict(self) | {"candidates": candidates, "said": self.describe()}


def clause(found: dict[str, Any]) -> str:
    """The calibration's clause of the banner and of ``slidedp plan``'s report, from its
    summary (``Calibration.summary``, or ``{"skipped": why}``; a cached plan keeps only that)."""
    if "skipped" in found:
        return f"not calibrated ({found['skipped']})"
    return f"calibrated ({found['steps']} steps each): {found['said']}"


def _trial_layout(policy: LayerPolicy, replaced: int, layers: int, choice: Choice) -> str:
    """``replaced`` layers on ``policy``, the rest on the default, placed as the run places
    them (``plan.layout.place``)."""

    retained = {_policy(c): int(c.retained_bytes) for c in choice.problem.candidates}
    counts = [(policy, replaced), (DEFAULT, layers - replaced)]
    return format_layout(place([(p, n) for p, n in counts if n > 0], retained))


def _profiled_times_s(choice: Choice) -> dict[LayerPolicy, float]:
    return {_policy(c): c.time_s for c in choice.problem.candidates}


def _with_layers(cfg: TrainConfig, layout: str) -> TrainConfig:
    return dataclasses.replace(cfg, runtime=cfg.runtime.with_keys(layers=layout))


def calibrate_choice(
    cfg: TrainConfig, choice: Choice, *, steps: int, runner: Runner
) -> Calibration:
    """The shortlisted candidates of ``choice`` (solved with the profiled times of ``cfg``'s
    run) calibrated by ``runner`` on the reduced model, ``steps`` steps each trial."""

    layers = min(REDUCED_LAYERS, choice.problem.layers)
    replaced = max(1, layers // 2)
    profiled = _profiled_times_s(choice)
    tau_0 = profiled[DEFAULT]
    found: list[Calibrated] = []
    with tempfile.TemporaryDirectory(prefix="slidedp-calibrate-") as tmp:
        model = reduced_model(Path(cfg.model.path), layers, Path(tmp) / "model")
        reduced = default_config(
            dataclasses.replace(cfg, model=dataclasses.replace(cfg.model, path=str(model)))
        )
        before = runner(reduced, steps).step_s
        trials = []  # (candidate, T_j)
        for policy in shortlist(choice) if before is not None else []:
            layout = _trial_layout(policy, replaced, layers, choice)
            trials.append((policy, runner(_with_layers(reduced, layout), steps).step_s))
        ran = any(t_j is not None for _, t_j in trials)
        after = runner(reduced, steps).step_s if ran else None
        t_0, spread = before, None
        if before is not None and after is not None:
            t_0, spread = (before + after) / 2, abs(before - after)
        for policy, t_j in trials:
            tau_j = None
            if (  # moved only beyond the default's own run-to-run spread
                t_0 is not None
                and t_j is not None
                and spread is not None
                and abs(t_j - t_0) > spread
            ):
                tau_j = calibrated_time_s(tau_0, t_0, t_j, replaced)
            found.append(Calibrated(policy, profiled[policy], t_j, tau_j))
    return Calibration(steps, layers, replaced, tau_0, t_0, spread, tuple(found))
