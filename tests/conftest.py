from __future__ import annotations

from collections.abc import Iterator

import pytest

from slidedp.kernels import Kernels


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
