"""Subprocess helpers of the signal / kill tests: start a child script and wait until it marks that it is
writing, list its descendants, and check that none of them is left."""

import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]


def start_until_marked(script: Path, mark: Path, timeout: float = 120.0) -> subprocess.Popen:
    """Run ``script`` (own session, pipes for stdout/stderr) and return once it has created ``mark``."""
    proc = subprocess.Popen([sys.executable, str(script)], cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True, start_new_session=True)
    deadline = time.time() + timeout
    while not mark.exists():
        assert proc.poll() is None, proc.communicate()
        assert time.time() < deadline, "the child never started writing"
        time.sleep(0.05)
    return proc


def descendants(pid) -> list:
    import psutil

    return psutil.Process(pid).children(recursive=True)


def assert_gone(procs, timeout=10):
    import psutil

    _, alive = psutil.wait_procs(procs, timeout=timeout)
    assert alive == [], f"processes left behind: {alive}"
