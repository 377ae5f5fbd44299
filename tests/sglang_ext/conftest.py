"""Fixtures for the SGLang plugin tests: one SGLang import, a 1-rank gloo TP group, tiny checkpoints.

SGLang 0.5.23 is installed --no-deps; importing it on CPU takes ~10-20 s, so everything that
touches it is session-scoped. What cannot run on CPU (the server's model runner, CUDA graph
capture, the Triton kernels at speed) is not exercised here.
"""

from __future__ import annotations

import pytest

from sglang_fixtures import export_rollout_checkpoints, init_sglang_runtime


@pytest.fixture(scope="session")
def sglang_runtime():
    """Plugins loaded through SGLang's own loader, plus world-size-1 gloo model-parallel groups."""
    return init_sglang_runtime()


@pytest.fixture(scope="session")
def checkpoints(tmp_path_factory):
    """Tiny rollout checkpoints written by the project's exporter, keyed by kind."""
    return export_rollout_checkpoints(tmp_path_factory.mktemp("sglang_ckpts"))

