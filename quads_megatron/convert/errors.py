"""The one exception every converter raises for bad input, so CLIs can print it without a traceback."""


class CheckpointError(ValueError):
    """A checkpoint (or its config) is missing, malformed, or does not match what is expected."""
