"""The user-facing errors of every CLI and the GRPO job, and the one wrapper that turns them into exit code 2.

A user error (bad flag, config, file, tensor) is a ``QuadsError`` subclass whose message names the
file or tensor, what was expected and what was found; ``run_cli`` prints it as one line and exits 2.
Anything else is a bug and keeps its traceback. SIGINT/SIGTERM end with one line and exit 128 + signal;
the atomic writers (``quads_megatron.output_dir``) remove their partial output on the way out.
"""

from __future__ import annotations

import contextlib
import os
import queue
import signal
import sys
import threading
import time

EXIT_USER_ERROR = 2


class QuadsError(Exception):
    """Base of every error caused by the user's input rather than by a bug."""


class ConfigError(QuadsError, ValueError):
    """A flag, recipe or config.json field has a wrong type, range or combination."""


class InputError(QuadsError, ValueError):
    """An input file or tensor (prompts, calibration data, weights) is unreadable or malformed."""


class CheckpointError(QuadsError, ValueError):
    """A checkpoint (or its config) is missing, malformed, corrupt, or does not match what is expected."""


class NonFiniteError(InputError):
    """A tensor, loss, gradient norm or log-prob that must be finite holds NaN or Inf."""


class Interrupted(BaseException):
    """SIGINT/SIGTERM: not an Exception, so ``except Exception`` cleanup paths do not swallow it."""

    def __init__(self, signum: int):
        super().__init__(signal.Signals(signum).name)
        self.signum = signum


# A Python signal handler runs at the main thread's next bytecode, wherever that is.  Where CPython can only
# report an exception (``os.register_at_fork`` hooks such as logging's lock release, ``__del__``), an
# ``Interrupted`` raised there is printed and lost, and the process carries on (e.g. waits for the shard
# writers it was meant to stop).  So during a fork the handler does not raise, and a swallowed
# ``Interrupted`` is not printed: either way the signal is sent to the main thread again a moment later,
# by a helper thread, and raised in ordinary code (a blocking wait of the main thread wakes up for it).
_IN_FORK = []        # monotonic times: one per fork bracket the main thread is inside (brackets nest)
_FORK_STALE_S = 1.0  # a mark this old was left by a handler that raised in a closing hook: ignore it
_REDELIVER = []      # [queue] of the helper thread, started on first use
_REDELIVER_DELAY_S = 0.05


def _redeliver_loop(q, main_ident) -> None:
    """Helper thread: send each queued signal to the main thread again, once it had time to leave the hooks."""
    while True:
        signum = q.get()
        time.sleep(_REDELIVER_DELAY_S)
        with contextlib.suppress(ProcessLookupError, OSError):
            signal.pthread_kill(main_ident, signum)


def _redeliver(signum: int) -> None:
    """Have ``signum`` raised again in the main thread shortly (it could not be raised where it landed)."""
    if not _REDELIVER:
        _REDELIVER.append(queue.SimpleQueue())
        threading.Thread(target=_redeliver_loop, args=(_REDELIVER[0], threading.main_thread().ident),
                         name="quads-signal-redeliver", daemon=True).start()
    _REDELIVER[0].put(signum)


def _in_fork() -> bool:
    """Whether the main thread is inside fork hooks (a mark older than a fork can take is stale)."""
    return bool(_IN_FORK) and time.monotonic() - _IN_FORK[-1] < _FORK_STALE_S


def _fork_begins() -> None:
    now = time.monotonic()
    _IN_FORK[:] = [t for t in _IN_FORK if now - t < _FORK_STALE_S] + [now]


def _fork_ends() -> None:
    if _IN_FORK:
        _IN_FORK.pop()


def _fork_child() -> None:
    """In a forked child: not inside a fork any more, and the parent's helper thread does not exist here."""
    _IN_FORK.clear()
    _REDELIVER.clear()


def bracket_forks() -> None:
    """Register a fork bracket: it encloses every fork hook registered before it (the last registered runs
    first before a fork and last after it).  Signals raise in ordinary code only while inside one; call it
    again after importing modules that register their own Python fork hooks (filelock does)."""
    if hasattr(os, "register_at_fork"):
        os.register_at_fork(before=_fork_begins, after_in_parent=_fork_ends, after_in_child=_fork_child)


_FORK_BRACKET = []


@contextlib.contextmanager
def signals_held():
    """Hold SIGINT/SIGTERM back for the block (delivered after it), so cleanup and renames finish."""
    old = signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGINT, signal.SIGTERM})
    try:
        yield
    finally:
        signal.pthread_sigmask(signal.SIG_SETMASK, old)


@contextlib.contextmanager
def signals_as_interrupt():
    """Raise ``Interrupted`` on SIGINT/SIGTERM inside the block (main thread only), then restore handlers.

    A signal that lands in a fork hook, or whose ``Interrupted`` CPython swallows (``sys.unraisablehook``),
    is raised again in ordinary code a moment later instead of being lost."""
    def _raise(signum, frame):
        if _in_fork():
            _redeliver(signum)
            return
        raise Interrupted(signum)

    def _unraisable(info):
        if not isinstance(info.exc_value, Interrupted):
            hook(info)
            return
        try:
            _redeliver(info.exc_value.signum)
        except Interrupted as e:   # the redelivered signal landed in here already
            _redeliver(e.signum)

    previous = {}
    try:
        for sig in (signal.SIGINT, signal.SIGTERM):
            previous[sig] = signal.signal(sig, _raise)
    except ValueError:  # not the main thread: leave signals alone
        pass
    hook = sys.unraisablehook
    if previous and not _FORK_BRACKET:
        bracket_forks()
        _FORK_BRACKET.append(True)
    if previous:
        sys.unraisablehook = _unraisable
    try:
        yield
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)
        if previous:
            sys.unraisablehook = hook


def run_cli(main, argv=None, prog: str | None = None) -> int:
    """Run ``main(argv)``: 0 on success, 2 with one line for a QuadsError, 128+N with one line on a signal."""
    prog = prog or "quads"
    try:
        with signals_as_interrupt():
            main(argv)
    except QuadsError as e:
        print(f"{prog}: error: {e}", file=sys.stderr, flush=True)
        return EXIT_USER_ERROR
    except Interrupted as e:
        print(f"{prog}: interrupted by {e}; partial output removed", file=sys.stderr, flush=True)
        return 128 + e.signum
    return 0
