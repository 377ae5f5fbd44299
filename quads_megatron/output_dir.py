"""The one way this project writes an output directory: locked, checked, written aside, renamed into place.

Every writer (the converters, the rollout exporter, GRPO iterations and their ``hf/`` side copy,
``quads-pretrain``, the SGLang disk weight sync) goes through ``atomic_output_dir``:

* **Checks first** (``check_output_path``): an output that is, contains or lies inside one of the
  run's inputs is refused, even with ``--force``; an existing output is refused without ``--force``,
  and ``--force`` replaces only what this project wrote (a directory holding ``quads_manifest.json``,
  or an empty one) -- anything else is refused with a message naming what is there.
* **An exclusive lock** (``filelock``) on ``.NAME.lock`` beside the output, holding the holder's
  pid, host and command: a second writer of the same output stops with a ``CheckpointError`` (exit 2)
  naming the holder.  ``claim_output`` takes it for a whole run (a converter from its first check to
  its last write, a GRPO job on its ``--save`` directory); nested claims of the same process are free.
* **Written aside**: a hidden ``.NAME.partial-PID-XXXX`` sibling (same filesystem) gets every file and
  ``quads_manifest.json`` last, then is renamed onto ``NAME``; a replaced output waits in
  ``.NAME.old-PID-XXXX`` until the new one is in place.  Temporaries of dead runs (SIGKILL, power loss)
  are removed by the next writer of the same output, and a replaced checkpoint whose replacement never
  made it is put back.  SIGINT/SIGTERM (``Interrupted`` from ``run_cli``) remove the partial output;
  signals are held while it is removed or renamed, so a second Ctrl-C cannot leave half of it behind.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import shutil
import socket
import sys
import tempfile
import time
from pathlib import Path

import filelock

from quads_megatron.errors import CheckpointError, signals_held
from quads_megatron.integrity import MANIFEST, write_manifest

MARKER = ".quads_output"   # in an output written without a manifest (a scratch copy): it is ours to replace
_STALE_RE = re.compile(r"^\.(?P<name>.+)\.(?P<kind>partial|old)-(?P<pid>\d+)-[^/]+$")
_LOCK_SUFFIX = ".lock"
_HELD: dict = {}     # lock path -> [FileLock, depth]: the outputs this process holds (claims nest)


# ---------------------------------------------------------------- checks


def _first_existing(path: Path) -> Path:
    """``path`` or its nearest existing ancestor."""
    while not path.exists() and path != path.parent:
        path = path.parent
    return path


def check_not_inside_inputs(path, inputs, *, flag: str = "--save-dir") -> None:
    """Refuse an output that equals, contains or lies inside one of ``inputs`` (``(flag, path)`` pairs,
    None paths skipped; symlinks resolved): writing there would destroy the input."""
    out = Path(path).resolve()
    for in_flag, src in inputs:
        if src is None:
            continue
        src_r = Path(src).resolve()
        if out == src_r or out.is_relative_to(src_r) or src_r.is_relative_to(out):
            raise CheckpointError(f"{flag} {path} overlaps {in_flag} {src} (resolved: {out} and {src_r}); "
                                  f"writing there would destroy the input: choose another {flag}")


def written_by_us(path) -> bool:
    """Whether ``path`` is a directory this project may replace: empty, holding our ``quads_manifest.json``
    (or, for a scratch output written without one such as the SGLang disk sync, our ``.quads_output``
    marker)."""
    path = Path(path)
    return path.is_dir() and (not any(path.iterdir()) or (path / MANIFEST).is_file() or (path / MARKER).is_file())


def describe_contents(path, limit: int = 5) -> str:
    """``'a.txt', 'b/' and 3 more`` for the entries of a directory (for refusals that name what is there)."""
    names = sorted(p.name + ("/" if p.is_dir() else "") for p in Path(path).iterdir())
    shown = ", ".join(repr(n) for n in names[:limit])
    return shown + (f" and {len(names) - limit} more" if len(names) > limit else "")


def check_replaceable(path, *, flag: str = "--save-dir") -> None:
    """``--force`` replaces only what this project wrote: refuse anything else, naming what is there."""
    path = Path(path)
    if not path.is_dir():
        raise CheckpointError(f"{flag} {path}: exists and is not a directory; --force replaces only a directory "
                              "this project wrote")
    if not written_by_us(path):
        raise CheckpointError(f"{flag} {path}: --force replaces only a directory this project wrote (with {MANIFEST}) "
                              f"or an empty one, and {path} holds {describe_contents(path)}: move it away yourself "
                              f"or choose another {flag}")


def check_output_path(path, *, force: bool = False, inputs=(), flag: str = "--save-dir") -> Path:
    """Refuse, before any work starts, an output that overlaps an input (even with ``force``), exists
    (unless ``force`` and ``written_by_us``) or cannot be created; return it as a Path.  Temporaries of
    dead runs are cleaned up first (a replaced checkpoint goes back before the checks)."""
    path = Path(path)
    check_not_inside_inputs(path, inputs, flag=flag)
    try:
        remove_stale_temp_dirs(path)
    except OSError as e:
        raise CheckpointError(f"{flag} {path}: cannot clean up a dead run's temporary directory ({e})") from None
    if path.exists() or path.is_symlink():
        if not force:
            raise CheckpointError(f"output {path} already exists; pass --force to replace it")
        check_replaceable(path, flag=flag)
    base = _first_existing(path.parent)
    if not base.is_dir():
        raise CheckpointError(f"{flag} {path}: {base} is not a directory")
    if not os.access(base, os.W_OK | os.X_OK):
        raise CheckpointError(f"{flag} {path}: directory {base} is not writable")
    return path


# ---------------------------------------------------------------- the lock


def lock_path(path) -> Path:
    """``.NAME.lock`` beside ``path`` (the output itself is renamed, so the lock cannot live inside it)."""
    path = Path(path).absolute()
    return path.parent / f".{path.name}{_LOCK_SUFFIX}"


def _holder_record() -> bytes:
    cmd = " ".join([os.path.basename(sys.argv[0] or "python"), *sys.argv[1:]])[:300]
    return json.dumps({"pid": os.getpid(), "host": socket.gethostname(), "command": cmd,
                       "since": time.strftime("%Y-%m-%d %H:%M:%S %Z")}).encode() + b"\n"


def _write_holder(fd: int) -> None:
    os.ftruncate(fd, 0)
    os.pwrite(fd, _holder_record(), 0)


def lock_holder(path) -> str:
    """Who holds the lock of output ``path``, as recorded in its lock file ('unknown' when unreadable)."""
    try:
        doc = json.loads(lock_path(path).read_text())
        return f"pid {doc['pid']} on {doc['host']} since {doc['since']} ({doc['command']})"
    except (OSError, ValueError, KeyError, TypeError):
        return "a process that has not recorded itself yet"


@contextlib.contextmanager
def output_lock(path, *, flag: str = "--save-dir"):
    """Hold the exclusive lock of output ``path`` for the block (re-entrant within this process).

    A second process (or host, on a filesystem with working ``flock``) writing the same output gets a
    ``CheckpointError`` naming the holder at once; the lock file is removed when the lock is released."""
    lp = lock_path(path)
    key = str(lp)
    if key in _HELD:
        _HELD[key][1] += 1
        try:
            yield lp
        finally:
            _HELD[key][1] -= 1
        return
    try:
        lp.parent.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise CheckpointError(f"output {path}: cannot create it ({e.strerror or e})") from None
    lock = filelock.FileLock(lp, timeout=1.0, thread_local=False, on_acquired=_write_holder)
    try:
        lock.acquire()
    except filelock.Timeout:
        raise CheckpointError(f"{flag} {path}: another writer holds it ({lock_holder(path)}; lock file {lp}); "
                              f"wait for it to finish or choose another {flag}") from None
    except OSError as e:
        raise CheckpointError(f"{flag} {path}: cannot lock {lp} ({e.strerror or e})") from None
    _HELD[key] = [lock, 1]
    try:
        yield lp
    finally:
        with signals_held():
            del _HELD[key]
            with contextlib.suppress(OSError):
                lp.unlink()         # while held: a waiter that opened it sees a removed inode and retries
            lock.release()


def holds_lock(path) -> bool:
    """Whether this process holds the lock of output ``path``."""
    return str(lock_path(path)) in _HELD


def is_writer_rank() -> bool:
    """Rank 0 (or no torch.distributed job): the one process of a job that locks, renames and cleans up.
    Before ``init_process_group`` the launcher's ``RANK`` decides."""
    try:
        import torch.distributed as dist

        if dist.is_available() and dist.is_initialized():
            return dist.get_rank() == 0
    except ImportError:
        pass
    return os.environ.get("RANK", "0") == "0"


@contextlib.contextmanager
def claim_output(path, *, force: bool = False, inputs=(), flag: str = "--save-dir"):
    """Check ``path`` (``check_output_path``) and hold its lock for the block on the writer rank: a run
    claims its output before its first expensive step, so a second run stops at once, not at the rename."""
    path = check_output_path(path, force=force, inputs=inputs, flag=flag)
    if not is_writer_rank():
        yield path
        return
    with output_lock(path, flag=flag):
        check_output_path(path, force=force, inputs=inputs, flag=flag)   # again: the previous holder may have written it
        yield path


# ---------------------------------------------------------------- temporaries


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


def _stale_in(directory: Path, name: str | None) -> list:
    if not directory.is_dir():
        return []
    out = []
    for p in sorted(directory.iterdir()):
        m = _STALE_RE.match(p.name)
        if m and (name is None or m["name"] == name) and p.is_dir() and not _pid_alive(int(m["pid"])):
            out.append((m["kind"], p, directory / m["name"]))
    return out


def stale_temp_dirs(path) -> list:
    """``(kind, temporary)`` for the ``.NAME.partial-*`` / ``.NAME.old-*`` siblings of ``path`` whose process is gone."""
    path = Path(path)
    return [(kind, p) for kind, p, _ in _stale_in(path.parent, path.name)]


def _remove_stale(entries) -> None:
    for kind, p, target in entries:
        if kind == "old" and (p / "ckpt").is_dir() and not target.exists():
            os.rename(p / "ckpt", target)
        shutil.rmtree(p, ignore_errors=True)


def remove_stale_temp_dirs(path) -> None:
    """Remove what a dead run left beside ``path``; a replaced checkpoint (``.old-*``) goes back to
    ``path`` when the run died before the new one was in place."""
    path = Path(path)
    _remove_stale(_stale_in(path.parent, path.name))


def remove_stale_temp_dirs_in(directory) -> None:
    """The same for every output inside ``directory`` (a GRPO ``--save`` directory: its ``iter_*`` and
    ``hf`` temporaries of a killed run, whichever iteration it was writing)."""
    _remove_stale(_stale_in(Path(directory), None))


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


# ---------------------------------------------------------------- the writer


def _collective() -> bool:
    try:
        import torch.distributed as dist
    except ImportError:
        return False
    return dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1


def _share(value):
    """Rank 0's ``value`` on every rank (a no-op outside a multi-process job)."""
    if not _collective():
        return value
    import torch.distributed as dist

    box = [value]
    dist.broadcast_object_list(box, src=0)
    return box[0]


def _barrier() -> None:
    if _collective():
        import torch.distributed as dist

        dist.barrier()


@contextlib.contextmanager
def _optional_lock(path, lock: bool, flag: str):
    if lock:
        with output_lock(path, flag=flag):
            yield
    else:
        yield


@contextlib.contextmanager
def atomic_output_dir(path, *, force: bool = False, inputs=(), flag: str = "--save-dir", lock: bool = True,
                      manifest: bool = True, collective: bool = False):
    """Yield a temporary directory that becomes ``path`` when the block ends without error.

    ``path`` is checked (``check_output_path``: inputs, ``--force`` over our own outputs only) and locked
    (``lock=False`` inside an output the caller already holds, e.g. an iteration of a locked ``--save``
    directory).  On any exception (including ``Interrupted`` from SIGINT/SIGTERM) the temporary
    directory is removed, so a failure never leaves a half-written output at ``path``.  The finished
    directory gets ``quads_manifest.json`` as its last file (``manifest=False``: a scratch copy that is
    rewritten every step, such as the SGLang disk sync, gets the ``.quads_output`` marker instead, unless the
    block wrote a manifest itself); an OSError while writing (full or read-only
    filesystem) becomes a CheckpointError naming ``path``.

    ``collective=True``: every rank of a torch.distributed job enters with the same ``path`` and writes
    its share into the one temporary directory (a dist_checkpointing save); rank 0 locks, creates, hashes
    and renames, after a barrier.
    """
    path = Path(path)
    shared = collective and _collective()
    writer = not shared or is_writer_rank()
    if writer:
        error, tmp = None, None
        try:
            check_output_path(path, force=force, inputs=inputs, flag=flag)
            stack = contextlib.ExitStack()
            stack.enter_context(_optional_lock(path, lock, flag))
            try:
                check_output_path(path, force=force, inputs=inputs, flag=flag)
                tmp = make_temp_dir(path)
            except BaseException:
                stack.close()
                raise
        except CheckpointError as e:
            error = str(e)
            if not shared:
                raise
        if shared:
            _share(("error", error) if error is not None else ("tmp", str(tmp)))
            if error is not None:
                raise CheckpointError(error)
    else:
        kind, value = _share(None)
        if kind == "error":
            raise CheckpointError(value)
        tmp, stack = Path(value), contextlib.ExitStack()
    with stack:
        try:
            yield tmp
            if shared:
                _barrier()          # every rank's files are on disk before they are hashed
            if writer and manifest:
                write_manifest(tmp)
            elif writer and not (tmp / MANIFEST).is_file():
                (tmp / MARKER).write_text(json.dumps({"writer": "quads-megatron", "manifest": False}) + "\n")
            if writer:
                commit_temp_dir(tmp, path)
        except OSError as e:
            if writer:
                remove_temp_dir(tmp)
            where = f" ({e.filename})" if e.filename else ""
            raise CheckpointError(f"output {path}: write failed{where}: {e.strerror or e}") from None
        except BaseException:
            if writer:
                remove_temp_dir(tmp)
            raise
        if shared:
            _barrier()
