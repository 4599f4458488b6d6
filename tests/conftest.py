from __future__ import annotations

import os
from collections.abc import Iterator


def _one_share_of_the_cores() -> None:
    """Under pytest-xdist, worker N keeps to its share of the cores (one core on a 2-core
    machine with 2 workers), and so do the ranks, workers and pools its tests start: slidedp
    sizes its thread pools by the affinity mask, and two tests that each take every core would
    oversubscribe the machine. Before torch is imported, so that OpenMP sizes its pool by it."""
    worker = os.environ.get("PYTEST_XDIST_WORKER", "")
    count = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1"))
    cores = sorted(os.sched_getaffinity(0))
    if not worker.startswith("gw") or count < 2:
        return
    index = int(worker.removeprefix("gw"))
    share = max(1, len(cores) // count)
    start = (index * share) % len(cores)
    os.sched_setaffinity(0, cores[start : start + share])


_one_share_of_the_cores()

import pytest  # noqa: E402

from slidedp.kernels import Kernels  # noqa: E402

pytest_plugins = ("tier_guard", "pytester")


@pytest.fixture(params=Kernels.supported_isas())
def isa(request: pytest.FixtureRequest) -> str:
    """Every instruction-set path this CPU can run (AVX-512 only on the GPU host)."""
    return str(request.param)


@pytest.fixture(autouse=True, scope="session")
def _own_measurement_cache(tmp_path_factory: pytest.TempPathFactory) -> Iterator[None]:
    """Profiles and host probes cached by this session only: a ``slidedp profile host`` run on
    this machine would otherwise replace the table rate the tests expect."""
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("XDG_CACHE_HOME", str(tmp_path_factory.mktemp("xdg-cache")))
        yield
