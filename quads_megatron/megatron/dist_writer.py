"""dist_checkpointing saves that leave no writer process behind and always end on SIGINT/SIGTERM.

Megatron's torch_dist writer (``filesystem_async``) forks one shard writer per bucket and collects
their results through a spawn-context ``Manager().Queue()``: a server process that outlives a
killed parent and keeps its stdout/stderr open (a ``| tee`` then hangs).  ``no_orphan_writers``
runs a synchronous save without that server (the collector runs in this process, a thread queue
does the job), gives the forked writers PR_SET_PDEATHSIG (a SIGKILLed parent takes them along),
and kills every process forked during the save when the save ends with an exception (a signal).

A signal during the save ends it wherever it lands: ``quads_megatron.errors.signals_as_interrupt``
raises one that arrives while this process forks a writer (inside the fork hooks, where CPython would
swallow the exception) right after the fork instead.
"""

import contextlib
import multiprocessing
import os
import queue
import signal
import time

from quads_megatron.errors import bracket_forks, signals_held

_SIGNALS = (signal.SIGINT, signal.SIGTERM)
_IN_SAVE = []       # non-empty while a save runs: forked children then die with this process
_FORK_HOOK = []


def _child_after_fork() -> None:
    """In a shard writer forked during a save: default signal actions, die with the parent (PR_SET_PDEATHSIG)."""
    if not _IN_SAVE:
        return
    for sig in _SIGNALS:
        signal.signal(sig, signal.SIG_DFL)
    try:
        import ctypes

        ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGKILL)   # 1 = PR_SET_PDEATHSIG
    except (OSError, AttributeError):
        pass


def _install_fork_hooks() -> None:
    """Register the child's fork hook once, and a signal bracket around every fork hook the imports of the
    first save (Megatron, filelock, ...) registered (``quads_megatron.errors.bracket_forks``)."""
    if not _FORK_HOOK and hasattr(os, "register_at_fork"):
        os.register_at_fork(after_in_child=_child_after_fork)
        bracket_forks()
        _FORK_HOOK.append(True)


def _child_pids() -> set:
    """Pids of this process's children (from /proc: a child forked just before a signal may be unknown to
    multiprocessing), or of multiprocessing's live children where there is no /proc."""
    me = str(os.getpid())
    if not os.path.isdir("/proc/self"):
        return {p.pid for p in multiprocessing.active_children()}
    pids = set()
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat") as f:
                fields = f.read().rsplit(")", 1)[1].split()
        except (OSError, IndexError):
            continue
        if fields[1] == me:   # fields after "(comm)": state, ppid, ...
            pids.add(int(entry))
    return pids


def _kill_children(pids: set, timeout: float = 5.0) -> None:
    """SIGKILL ``pids`` (children of this process) and reap them, multiprocessing's own through ``join``."""
    for child in multiprocessing.active_children():
        if child.pid in pids:
            child.kill()
            child.join(timeout=timeout)
            pids.discard(child.pid)
    for pid in pids:
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)
    deadline = time.monotonic() + timeout
    for pid in pids:
        with contextlib.suppress(ChildProcessError):
            while os.waitpid(pid, os.WNOHANG) == (0, 0) and time.monotonic() < deadline:
                time.sleep(0.01)


@contextlib.contextmanager
def no_orphan_writers():
    """Run a synchronous dist_checkpointing save without Megatron's Manager server; every process forked
    during it dies with this process, and is killed (signals held meanwhile) when the block raises."""
    from megatron.core.dist_checkpointing.strategies import filesystem_async as fsa

    _install_fork_hooks()
    patch = hasattr(fsa, "_results_queue")
    previous = getattr(fsa, "_results_queue", None)
    if patch:
        fsa._results_queue = queue.Queue()
    before = _child_pids()
    _IN_SAVE.append(True)
    try:
        yield
    except BaseException:
        # a signal or error while shard writers run: stop them now (interpreter exit would wait for them)
        with signals_held():
            _kill_children(_child_pids() - before)
        raise
    finally:
        _IN_SAVE.clear()
        if patch:
            fsa._results_queue = previous
