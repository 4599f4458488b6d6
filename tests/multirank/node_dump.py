"""``python -m multirank.node_dump train CONFIG ...``: ``slidedp train`` as a node's launcher
whose ranks each run this module too, so that when training ends each node's local rank 0
saves its host state (``ranks.dump_node_state``) into ``$SLIDEDP_TEST_DUMP`` — the real-launch
counterpart of ``run_ranks(dump=...)`` (tests/multirank/test_gpu_nodes.py). ``tests`` must be
on ``PYTHONPATH``."""

from __future__ import annotations

import functools
import os
import sys
from pathlib import Path

DUMP = "SLIDEDP_TEST_DUMP"
MODULE = "multirank.node_dump"


def main() -> int:
    from multirank.ranks import dump_node_state
    from slidedp import cli
    from slidedp.runtime import launch

    if "RANK" in os.environ:  # a rank this module's launcher started
        rank, local_world = int(os.environ["RANK"]), int(os.environ["LOCAL_WORLD_SIZE"])
        dump_node_state(Path(os.environ[DUMP]), rank, local_world)
    else:  # the node's launcher: its ranks run this module instead of slidedp
        launch.launch = functools.partial(launch.launch, spec=launch.LaunchSpec(module=MODULE))
    return cli.main()


if __name__ == "__main__":
    sys.exit(main())
