"""The user-facing errors of every CLI and the GRPO job, and the one wrapper that turns them into exit code 2.

A user error (bad flag, config, file, tensor) is a ``QuadsError`` subclass whose message names the
file or tensor, what was expected and what was found; ``run_cli`` prints it as one line and exits 2.
Anything else is a bug and keeps its traceback. SIGINT/SIGTERM end with one line and exit 128 + signal;
the atomic writers (``convert.output_dir``) remove their partial output on the way out.
"""

from __future__ import annotations

import contextlib
import signal
import sys

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


@contextlib.contextmanager
def signals_as_interrupt():
    """Raise ``Interrupted`` on SIGINT/SIGTERM inside the block (main thread only), then restore handlers."""
    def _raise(signum, frame):
        raise Interrupted(signum)

    previous = {}
    try:
        for sig in (signal.SIGINT, signal.SIGTERM):
            previous[sig] = signal.signal(sig, _raise)
    except ValueError:  # not the main thread: leave signals alone
        pass
    try:
        yield
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)


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
