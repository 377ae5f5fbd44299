"""Test-session setup shared by every area.

Without a GPU, Triton kernels run in the CPU interpreter: TRITON_INTERPRET must be set
before triton.jit decorates anything, so it is set here, before any test module imports.
"""

import importlib.util
import os

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest  # noqa: E402

TOOLS = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "tools")


@pytest.fixture(scope="session")
def load_tool():
    """`load_tool("bench_refit")` -> tools/bench_refit.py as a fresh module (tools/ holds scripts, not a package)."""
    def load(name):
        spec = importlib.util.spec_from_file_location(name, os.path.join(TOOLS, f"{name}.py"))
        mod = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(mod)
        return mod
    return load


def pytest_collection_modifyitems(config, items):
    """Skip tests marked `gpu` when no CUDA device is present."""
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)
