"""Shared fixture: one tiny Qwen3-MoE HF checkpoint (the trainer's tiny preset, random BF16 weights) per session."""

import pytest

from convert_fixtures import save_tiny_hf


@pytest.fixture(scope="session")
def tiny_hf(tmp_path_factory):
    """Path of the session's tiny HF checkpoint (read-only for tests)."""
    return save_tiny_hf(tmp_path_factory.mktemp("tiny_hf") / "hf")
