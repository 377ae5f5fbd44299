"""Fixtures for the SGLang plugin tests: one SGLang import, a 1-rank gloo TP group, tiny checkpoints.

SGLang 0.5.23 is installed --no-deps; importing it on CPU takes ~10-20 s, so everything that
touches it is session-scoped. What cannot run on CPU (the server's model runner, CUDA graph
capture, the Triton kernels at speed) is not exercised here.
"""

from __future__ import annotations

import socket

import pytest

from sglang_fixtures import export_rollout_checkpoints


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="session")
def sglang_runtime():
    """Plugins loaded through SGLang's own loader, plus world-size-1 gloo model-parallel groups.

    This is what SGLang's scheduler does at start-up (load_plugins, init_distributed_environment,
    publish the server args, initialize_model_parallel), on CPU with gloo and TP = EP = 1.
    """
    from sglang.srt.distributed import parallel_state
    from sglang.srt.plugins import load_plugins
    from sglang.srt.runtime_context import SpawnRanks, get_parallel, publish, reset_context
    from sglang.srt.server_args import ServerArgs

    load_plugins()
    if not parallel_state.model_parallel_is_initialized():
        port = _free_port()
        parallel_state.init_distributed_environment(
            world_size=1, rank=0, local_rank=0, backend="gloo",
            distributed_init_method=f"tcp://127.0.0.1:{port}")
        reset_context()
        publish(ServerArgs(model_path="dummy", tp_size=1, ep_size=1, pp_size=1), role="test",
                ranks=SpawnRanks(world_rank=0))
        get_parallel().override_permanently(world_group=parallel_state._WORLD)
        parallel_state.initialize_model_parallel(backend="gloo")
    return parallel_state


@pytest.fixture(scope="session")
def checkpoints(tmp_path_factory):
    """Tiny rollout checkpoints written by the project's exporter, keyed by kind."""
    return export_rollout_checkpoints(tmp_path_factory.mktemp("sglang_ckpts"))


@pytest.fixture
def no_quads_env(monkeypatch):
    """Tests parse checkpoints without the QUADS_* environment overrides."""
    for var in ("QUADS_PRECISION", "QUADS_ACTIVATION_SCALING", "QUADS_RAC_CHANNELS"):
        monkeypatch.delenv(var, raising=False)
