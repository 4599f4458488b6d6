"""What a selection says (``autopolicy.choose``): why a stage did not run, and the banner
line of the choice (what runs, why, each stage's seconds, the break-even steps).

Example::

    line = head(choice, shown, "cached profile", host_said(host, 101.0), solve_s=0.02)
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from slidedp.autopolicy.calibrate import why_not_calibrated
from slidedp.autopolicy.select import MIN_GAIN

if TYPE_CHECKING:
    from slidedp.autopolicy.clock import Clock
    from slidedp.autopolicy.select import Choice
    from slidedp.autopolicy.validate import Validation
    from slidedp.plan.machine import HostRate

ELSEWHERE = "planned for another GPU (--gpu-memory)"
TRAIN_VALIDATES = "`slidedp train` validates it"


def why_not_calibrated_here(
    steps: int, choice: Choice, *, elsewhere: bool, several: bool, measuring: bool
) -> str | None:
    """Why ``choice`` is not calibrated (None: it is): only where this process can run the
    trials on the target (one process, measuring, not planned for another GPU)."""
    if steps and elsewhere:
        return ELSEWHERE
    if steps and several:
        return "several ranks: the profiled times"
    if steps and not measuring:
        return "`slidedp train` calibrates"
    return why_not_calibrated(steps, choice)


def why_not_validated(steps: int, *, elsewhere: bool, measuring: bool, differs: bool) -> str | None:
    """Why the choice is not validated by running it beside the default (None: it is);
    ``differs``: the choice (layout, routes or chunk) is not the default."""
    if not steps:
        return "runtime.policy_validate_steps=0"
    if elsewhere:
        return ELSEWHERE
    if not measuring:
        return TRAIN_VALIDATES
    if not differs:
        return "the default chosen: nothing to compare"
    return None


def host_said(host: HostRate, update_gbps: float) -> str:
    """The host AdamW rate the program took (``update_gbps``) and where it came from: where it
    blends the probe's two rates (``select.program_update_gbps``), both."""
    if host.alone_gbps is None or update_gbps == host.gbps:
        return f"{host.gbps:.0f} GB/s {host.source}"
    return (
        f"{update_gbps:.0f} GB/s ({host.gbps:.0f} under copies for their share, "
        f"{host.alone_gbps:.0f} alone; {host.source})"
    )


def head(choice: Choice, shown: Choice, source: str, host: str, solve_s: float) -> str:
    """What runs (``shown``: the solver's ``choice`` or, after validation, the winner) and why,
    with the program's accounting; ``host``: the host rate as ``host_said`` says it."""

    if shown.kept_default and not choice.kept_default:  # validation kept the default
        verdict = (
            f" kept: the solver's {choice.program_layout}, predicted {choice.gain:.2f}x, "
            "did not run faster in validation"
        )
    elif choice.kept_default:
        verdict = (
            f" kept: the best layout, {choice.program_layout}, is predicted {choice.gain:.2f}x, "
            f"below the {1 + MIN_GAIN:.2f}x that leaving the default needs"
        )
    else:
        verdict = f", predicted {shown.gain:.2f}x the default all-F layout"
    return (
        f"policy   auto: {shown.layout}, {shown.resident_text}{verdict} "
        f"(layers and host update {shown.solution.step_s:.3f} vs "
        f"{shown.default.step_s:.3f} s, "
        f"activations {shown.solution.memory_bytes / 2**30:.2f} of "
        f"{shown.budget_bytes / 2**30:.2f} GiB; {source}, host AdamW {host}, "
        f"solved in {solve_s:.2f} s)"
    )


def validated(validation: Validation | None, steps: int, why: str | None) -> str:
    """The validation clause of the banner line (``why``: why it did not run)."""
    if validation is not None:
        return f"validated ({steps} steps each): {validation.describe()}"
    if why == TRAIN_VALIDATES:
        return "not validated here (`slidedp train` validates)"
    return f"not validated ({why})"


def selection(clock: Clock, validation: Validation | None) -> str:
    """The selection's seconds by stage, and the steps after which the choice paid for them."""
    if validation is None:
        return f"{clock.describe()}, break-even unknown (not validated)"
    steps = validation.break_even_steps(clock.total_s)
    even = "never (the default runs)" if steps is None else f"after {steps:,} steps"
    return f"{clock.describe()}, break-even {even}"
