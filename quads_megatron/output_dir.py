"""Atomic checkpoint directories: write into a temporary sibling, rename onto the target only on success.

Temporary siblings are named ``.NAME.partial-PID-XXXX`` (being written) and ``.NAME.old-PID-XXXX``
(the replaced checkpoint during ``--force``), so the next run of the same target removes the ones
whose process is dead (SIGKILL, power loss) and puts a replaced checkpoint back if the new one never
made it.  Signals (SIGINT/SIGTERM, raised as ``quads_megatron.errors.Interrupted`` by ``run_cli``)
remove the partial output; they are held off while it is removed or renamed, so a second Ctrl-C
cannot leave half of it behind.
"""

import contextlib
import os
import re
import shutil
import tempfile
from pathlib import Path

from quads_megatron.errors import CheckpointError, signals_held
from quads_megatron.integrity import write_manifest

_STALE_RE = re.compile(r"^\.(?P<name>.+)\.(?P<kind>partial|old)-(?P<pid>\d+)-[^/]+$")


def _first_existing(path: Path) -> Path:
    """``path`` or its nearest existing ancestor."""
    while not path.exists() and path != path.parent:
        path = path.parent
    return path


def check_not_inside_inputs(path, inputs) -> None:
    """Refuse an output that equals, contains or lies inside one of ``inputs`` (symlinks resolved)."""
    out = Path(path).resolve()
    for flag, src in inputs:
        if src is None:
            continue
        src_r = Path(src).resolve()
        if out == src_r or out.is_relative_to(src_r) or src_r.is_relative_to(out):
            raise CheckpointError(f"--save-dir {path} overlaps {flag} {src} (resolved: {out} and {src_r}); "
                                  "writing there would destroy the input: choose another --save-dir")


def check_output_path(path, *, force: bool = False, inputs=()) -> Path:
    """Refuse, before any work starts, an output that exists (unless ``force``), overlaps an input
    (``inputs``: ``(flag, path)`` pairs; even with ``force``), or cannot be created; return it as a Path.
    Temporary siblings of dead runs are cleaned up first (``remove_stale_temp_dirs``)."""
    path = Path(path)
    check_not_inside_inputs(path, inputs)
    try:
        remove_stale_temp_dirs(path)     # first: a dead run's replaced checkpoint goes back before the checks
    except OSError as e:
        raise CheckpointError(f"output {path}: cannot clean up a dead run's temporary directory ({e})") from None
    if path.exists() and not force:
        raise CheckpointError(f"output {path} already exists; pass --force to replace it")
    if path.exists() and not path.is_dir():
        raise CheckpointError(f"output {path} exists and is not a directory")
    base = _first_existing(path.parent)
    if not base.is_dir():
        raise CheckpointError(f"output {path}: {base} is not a directory")
    if not os.access(base, os.W_OK | os.X_OK):
        raise CheckpointError(f"output {path}: directory {base} is not writable")
    return path


def _pid_alive(pid: int) -> bool:
    """Whether process ``pid`` exists (ours counts as alive: its temporary dirs are in use)."""
    if pid == os.getpid():
        return True
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def stale_temp_dirs(path) -> list:
    """``.NAME.partial-*`` / ``.NAME.old-*`` siblings of ``path`` left by processes that are gone."""
    path = Path(path)
    if not path.parent.is_dir():
        return []
    out = []
    for p in sorted(path.parent.iterdir()):
        m = _STALE_RE.match(p.name)
        if m and m["name"] == path.name and p.is_dir() and not _pid_alive(int(m["pid"])):
            out.append((m["kind"], p))
    return out


def remove_stale_temp_dirs(path) -> None:
    """Remove what a dead run left beside ``path``; a replaced checkpoint (``.old-*``) goes back to
    ``path`` when the run died before the new one was in place."""
    path = Path(path)
    for kind, p in stale_temp_dirs(path):
        if kind == "old" and (p / "ckpt").is_dir() and not path.exists():
            os.rename(p / "ckpt", path)
        shutil.rmtree(p, ignore_errors=True)


def make_temp_dir(path) -> Path:
    """A fresh hidden directory beside ``path`` (same filesystem, so the final rename is atomic)."""
    path = Path(path)
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        remove_stale_temp_dirs(path)
        tmp = Path(tempfile.mkdtemp(prefix=f".{path.name}.partial-{os.getpid()}-", dir=path.parent))
        umask = os.umask(0)
        os.umask(umask)
        os.chmod(tmp, 0o777 & ~umask)  # mkdtemp makes it 0700; the checkpoint should look like any other dir
    except OSError as e:
        raise CheckpointError(f"output {path}: cannot create it ({e.strerror or e})") from None
    return tmp


def commit_temp_dir(tmp, path) -> None:
    """Move a finished temporary directory onto ``path``, replacing an old one (``--force``) last."""
    tmp, path = Path(tmp), Path(path)
    with signals_held():
        if path.exists():
            old = Path(tempfile.mkdtemp(prefix=f".{path.name}.old-{os.getpid()}-", dir=path.parent))
            os.rename(path, old / "ckpt")
            os.rename(tmp, path)
            shutil.rmtree(old, ignore_errors=True)
        else:
            os.rename(tmp, path)


def remove_temp_dir(tmp) -> None:
    """Remove a partial output, with signals held so a second Ctrl-C does not stop it halfway."""
    with signals_held():
        shutil.rmtree(tmp, ignore_errors=True)


@contextlib.contextmanager
def atomic_output_dir(path, *, force: bool = False, inputs=()):
    """Yield a temporary directory that becomes ``path`` when the block ends without error.

    On any exception (including ``Interrupted`` from SIGINT/SIGTERM) the temporary directory is
    removed, so an interrupted conversion never leaves a half-written checkpoint at ``path``; an
    existing ``path`` is refused unless ``force``.  The finished directory gets ``quads_manifest.json``
    (``quads_megatron.integrity``) as its last file; an OSError while writing (full or read-only
    filesystem) becomes a CheckpointError naming ``path``.
    """
    path = check_output_path(path, force=force, inputs=inputs)
    tmp = make_temp_dir(path)
    try:
        yield tmp
        write_manifest(tmp)
    except OSError as e:
        remove_temp_dir(tmp)
        where = f" ({e.filename})" if e.filename else ""
        raise CheckpointError(f"output {path}: write failed{where}: {e.strerror or e}") from None
    except BaseException:
        remove_temp_dir(tmp)
        raise
    commit_temp_dir(tmp, path)
