"""Shared helpers for the RL tests: a tiny, fast flag set for the GRPO job."""

import pytest

from tiny_flags import TINY


@pytest.fixture
def tiny_args(tmp_path):
    """Build flags for a few-second GRPO run writing under tmp_path."""
    def make(*extra, tb="tb"):
        return TINY + ["--tensorboard-dir", str(tmp_path / tb)] + list(extra)
    return make
