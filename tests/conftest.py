from __future__ import annotations

import pytest

from slidedp.kernels import Kernels


@pytest.fixture(params=Kernels.supported_isas())
def isa(request: pytest.FixtureRequest) -> str:
    """Every instruction-set path this CPU can run (AVX-512 only on the GPU host)."""
    return str(request.param)
