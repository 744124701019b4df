"""The three ways a training run ends early (`training.main` turns each into one line and an exit status), and the
one check of a numeric flag's value that every argument dataclass uses."""

import errno
import math
import os


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


def describe_write_error(error: OSError, what: str, path) -> tuple[str, int]:
    """(one-line message, exit status) for an OSError writing `what` to `path` (None: standard output): a full
    disk is the environment's fault (1); a path that cannot be written is the user's to change (2)."""
    where = f"{what} {path}" if path is not None else what
    if path is not None and not os.path.isabs(path) and not working_directory_exists():
        return f"cannot write {where}: the working directory was deleted; give an absolute path", 2
    if error.errno in (errno.ENOSPC, errno.EDQUOT):
        return f"no space left on device writing {where}: free some space, or write elsewhere", 1
    reason = error.strerror or str(error)
    if error.errno in (errno.EACCES, errno.EPERM, errno.EROFS, errno.ENAMETOOLONG, errno.ENOTDIR, errno.EISDIR,
                       errno.ENOENT, errno.EEXIST):
        return f"cannot write {where}: {reason}; choose another path", 2
    return f"cannot write {where}: {reason}", 1


def working_directory_exists() -> bool:
    """False when the working directory was deleted (relative paths then lead nowhere)."""
    try:
        os.getcwd()
        return True
    except FileNotFoundError:
        return False
