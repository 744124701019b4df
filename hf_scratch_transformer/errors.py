"""The three ways a training run ends early (`training.main` turns each into one line and an exit status), and the
one check of a numeric flag's value that every argument dataclass uses."""

import math


class UsageError(Exception):
    """A mistake in the command line, the corpus or the files given: the message says what to fix."""


class TrainingFault(Exception):
    """The run itself failed (non-finite loss, hub unreachable...): the message says what is kept on disk."""


class RunInterrupted(Exception):
    """SIGINT or SIGTERM arrived; a checkpoint was saved. `exit_code` is 128 + the signal number."""

    def __init__(self, message: str, signum: int):
        super().__init__(message)
        self.exit_code = 128 + signum


def check_range(flag: str, value, low: float, high: float = math.inf, *, low_ok: bool = True,
                high_ok: bool = True) -> None:
    """`--flag`'s value must be a finite number within [low, high] (bounds excluded where not ok); None (not given)
    passes. A UsageError names the flag, the value and the interval."""
    if value is None:
        return
    if isinstance(value, float) and not math.isfinite(value):
        raise UsageError(f"--{flag} must be a finite number, got {value}")
    if value < low or (value == low and not low_ok) or value > high or (value == high and not high_ok):
        upper = "∞)" if high == math.inf else f"{high}{']' if high_ok else ')'}"
        raise UsageError(f"--{flag} must be in {'[' if low_ok else '('}{low}, {upper}, got {value}: give a value in "
                         f"that range")
