"""The host update lanes of several ranks of one node: each rank's update worker (a pool of
cores/R threads) runs the AdamW of the groups it owns (``runtime.dist.group_owner``), all R
pools at once. The step-time model gives each owner a lane of its own (``StepSpec.owners``)
at ``owner_lane_gbps``.

Example::

    update_owners(groups=42, ranks=4)[:6]      # (0, 1, 2, 3, 0, 1)
    owner_lane_gbps(136.0, 4, pool_gbps=55.0, alone_gbps=160.0)
"""

from __future__ import annotations

from slidedp.runtime.dist import group_owner


def update_owners(groups: int, ranks: int) -> tuple[int, ...]:
    """Per group, the rank of ``ranks`` whose update worker runs its AdamW, as the engine
    assigns it; one rank: none (the model's one update lane)."""
    return tuple(group_owner(g, ranks) for g in range(groups)) if ranks > 1 else ()


def owner_lane_gbps(
    node_gbps: float, ranks: int, pool_gbps: float | None, alone_gbps: float | None
) -> float:
    """The AdamW rate of one owner's update lane while each of ``ranks`` ranks updates its
    own groups: ``pool_gbps`` (the host probe's R pools of cores/R threads at once, alone),
    slowed by the step's copies as much as the node's rate ``node_gbps`` is below its rate
    alone (``plan.timing.host_update_gbps``; no rate alone: ``pool_gbps`` as it is, the
    conditions ``node_gbps`` was measured in). No R-pool rate: ``node_gbps`` shared evenly.
    One rank: ``node_gbps``."""
    if ranks == 1:
        return node_gbps
    if pool_gbps is None:
        return node_gbps / ranks
    return pool_gbps * (1.0 if alone_gbps is None else node_gbps / alone_gbps)
