"""Atomic checkpoint directories: write into a temporary sibling, rename onto the target only on success."""

import contextlib
import os
import shutil
import signal
import tempfile
from pathlib import Path

from quads_megatron.errors import CheckpointError


def check_output_path(path, *, force: bool = False) -> Path:
    """Refuse an existing output (unless ``force``) before any work starts; return it as a Path."""
    path = Path(path)
    if path.exists() and not force:
        raise CheckpointError(f"output {path} already exists; pass --force to replace it")
    if path.exists() and not path.is_dir():
        raise CheckpointError(f"output {path} exists and is not a directory")
    return path


def make_temp_dir(path) -> Path:
    """A fresh hidden directory beside ``path`` (same filesystem, so the final rename is atomic)."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{path.name}.partial-", dir=path.parent))
    umask = os.umask(0)
    os.umask(umask)
    os.chmod(tmp, 0o777 & ~umask)  # mkdtemp makes it 0700; the checkpoint should look like any other dir
    return tmp


def commit_temp_dir(tmp, path) -> None:
    """Move a finished temporary directory onto ``path``, replacing an old one (``--force``) last."""
    tmp, path = Path(tmp), Path(path)
    if path.exists():
        old = Path(tempfile.mkdtemp(prefix=f".{path.name}.old-", dir=path.parent))
        os.rename(path, old / "ckpt")
        os.rename(tmp, path)
        shutil.rmtree(old, ignore_errors=True)
    else:
        os.rename(tmp, path)


@contextlib.contextmanager
def atomic_output_dir(path, *, force: bool = False):
    """Yield a temporary directory that becomes ``path`` when the block ends without error.

    On any exception (including Ctrl-C, and SIGTERM inside ``sigterm_as_exit()``) the temporary
    directory is removed, so an interrupted conversion never leaves a half-written checkpoint at
    ``path``; an existing ``path`` is refused unless ``force``.
    """
    path = check_output_path(path, force=force)
    tmp = make_temp_dir(path)
    try:
        yield tmp
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    commit_temp_dir(tmp, path)


@contextlib.contextmanager
def sigterm_as_exit():
    """Turn SIGTERM into SystemExit for the block, so ``atomic_output_dir`` cleans up on kill."""
    def _raise(signum, frame):
        raise SystemExit(128 + signum)

    try:
        previous = signal.signal(signal.SIGTERM, _raise)
    except ValueError:  # not the main thread: leave signals alone
        yield
        return
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, previous)
