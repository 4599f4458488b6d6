"""Loads the demo's scripts (``examples/demo/*.py``, not a package) as modules for the tests.

Example: ``prepare = load_demo_script("prepare")``.
"""

from __future__ import annotations

import importlib.util
from pathlib import Path
from types import ModuleType

DEMO_DIR = Path(__file__).resolve().parents[2] / "examples" / "demo"


def load_demo_script(name: str) -> ModuleType:
    spec = importlib.util.spec_from_file_location(f"demo_{name}", DEMO_DIR / f"{name}.py")
    assert spec is not None
    assert spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module
