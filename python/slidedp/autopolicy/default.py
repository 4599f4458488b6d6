"""Whether a run selects its policy (``runtime.policy: auto``) when its config does not say.

``default_policy(rt, device, world_size_env)``: AutoPolicy is the default on CUDA, unless the
config names a layout (``runtime.layers``, ``offload_ratio``, ``resident_layers``,
``resident_embeddings`` set away from their defaults), a policy file, or ``fixed``; CPU runs,
several nodes and ranks started by torchrun keep the fixed default. ``break_even_fallback``:
a run whose predicted break-even (a cold selection's time over the step time it saves) exceeds
its ``max_steps`` runs the fixed default, and its banner says why. An explicit ``auto`` is
never overruled.

Invariant: pure functions of the config and the machine facts given; nothing is measured.
"""

from __future__ import annotations

from dataclasses import dataclass

from slidedp.config_runtime import RuntimeSection

AUTO, FIXED = "auto", "fixed"
# the keys that name a layout: set, the config's layout runs (auto would refuse them anyway)
LAYOUT_KEYS = ("layers", "offload_ratio", "resident_layers", "resident_embeddings")
# a cold selection's time for the break-even's prediction: the target for Qwen3-4B on one GPU
# (measured on an H200: 104.7 s, 127 s with the process's start and imports:
# benchmarks/2026-11-28-decide-then-run-h200.md)
COLD_SELECTION_S = 120.0
# the speed-up the prediction assumes: the smallest one validation accepts in practice is
# 1.1x (autopolicy.select.MIN_GAIN); Qwen3-4B B=16 with clipping measured 1.73x
ASSUMED_GAIN = 1.2


@dataclass(frozen=True)
class DefaultPolicy:
    auto: bool  # the run selects its policy
    implicit: bool  # by the CUDA default rule, not by an explicit runtime.policy: auto
    why: str  # for the banner


def default_policy(rt: RuntimeSection, device: str, world_size_env: int = 1) -> DefaultPolicy:
    """Whether ``rt`` selects its policy on ``device`` (``"cuda"`` or ``"cpu"``, as resolved),
    ``world_size_env``: torchrun's ``WORLD_SIZE`` (1 where ``slidedp train`` launches)."""
    if rt.autopolicy.policy == AUTO:
        return DefaultPolicy(True, False, "runtime.policy: auto")
    if rt.autopolicy.policy == FIXED:
        return DefaultPolicy(False, False, "runtime.policy: fixed")
    if rt.autopolicy.policy:
        return DefaultPolicy(False, False, f"the policy file {rt.autopolicy.policy}")
    if device != "cuda":
        return DefaultPolicy(False, False, "the fixed default on CPU")
    named = [k for k in LAYOUT_KEYS if rt.get(k) != RuntimeSection().get(k)]
    if named:
        return DefaultPolicy(False, False, f"the config names the layout ({', '.join(named)})")
    if rt.launch.nodes > 1 or world_size_env > 1:
        return DefaultPolicy(False, False, "the fixed default: auto chooses on one host")
    return DefaultPolicy(True, True, "AutoPolicy, the default on CUDA (runtime.policy: fixed: off)")


def break_even_steps(step_s: float, selection_s: float, gain: float = ASSUMED_GAIN) -> float:
    """Steps after which a selection of ``selection_s`` seconds pays for itself, where it makes
    a ``step_s`` step ``gain`` times faster."""
    saved_s = step_s * (1 - 1 / gain)
    return selection_s / saved_s if saved_s > 0 else float("inf")


def break_even_fallback(
    max_steps: int, step_s: float | None, selection_s: float = COLD_SELECTION_S
) -> str | None:
    """Why the CUDA default runs the fixed default instead of selecting (None: it selects):
    the predicted break-even exceeds the run's ``max_steps``. ``step_s``: the fixed default's
    predicted step (None: unknown, it selects); a cached selection costs ``selection_s=0``."""
    if step_s is None:
        return None
    steps = break_even_steps(step_s, selection_s)
    if steps <= max_steps:
        return None
    return (
        f"policy   fixed default: a selection (~{selection_s:.0f} s) would pay back after "
        f"~{steps:,.0f} steps, more than train.max_steps={max_steps} "
        "(runtime.policy: auto selects anyway)"
    )
