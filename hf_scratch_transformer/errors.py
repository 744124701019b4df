"""Every error the package raises on purpose, under one base; the exit status each one ends a command with
(`exit_code`, which train.py, hf-scratch-translate, hf-scratch-export-ct2 and hf-scratch-demo all use); the one-line
message of a failed write; the one check of a numeric flag's value that every argument dataclass uses.

    ScratchTransformerError           exit 1   what the package raises; its message is one line for a user
    ├── UsageError                    exit 2   the user can fix it: a flag, a path, a corpus, a model directory
    ├── EnvironmentFault              exit 1   the machine refused: a full disk, a port in use, a broken stream
    ├── TrainingFault                 exit 1   a training run failed (non-finite loss, hub unreachable, disk full)
    └── RunInterrupted                128 + N  signal N arrived during a run

The other modules' errors derive from these: CorpusError (data/corpus_files.py), ModelLoadError
(translation/translate.py), InvalidOption (translation_core.py) and CT2Error (translation/ct2_backend.py) are
UsageErrors, DatasetsCacheError (data/loading.py) a TrainingFault; StdoutClosed (translation/cli.py), exit 0, ends
hf-scratch-translate quietly when the reader of its output leaves. This file imports only the standard library:
translation_core.py imports it, and both are copied into saved model directories for `trust_remote_code=True`.
"""

import errno
import math
import os
import signal
import sys
from collections.abc import Callable
from contextlib import contextmanager


class ScratchTransformerError(Exception):
    """An error of this package: the message says, in one line, what happened and what to do; `exit_code` is the
    status of a command that ends with it."""

    exit_code = 1


class UsageError(ScratchTransformerError):
    """A mistake in the command line, the corpus or the files given: the message says what to fix."""

    exit_code = 2


class EnvironmentFault(ScratchTransformerError):
    """The machine refused (a full disk, a port in use, an output that cannot be written): not the user's input."""

    exit_code = 1


class TrainingFault(ScratchTransformerError):
    """The run itself failed (non-finite loss, hub unreachable...): the message says what is kept on disk."""

    exit_code = 1


class RunInterrupted(ScratchTransformerError):
    """SIGINT or SIGTERM arrived; a checkpoint was saved. `exit_code` is 128 + the signal number."""

    def __init__(self, message: str, signum: int):
        super().__init__(message)
        self.exit_code = 128 + signum


def exit_code(error: BaseException) -> int:
    """The exit status of a command that ends with `error`: this package's errors carry theirs, Ctrl-C (an uncaught
    KeyboardInterrupt) is 128 + SIGINT = 130, anything else is 1."""
    if isinstance(error, ScratchTransformerError):
        return error.exit_code
    if isinstance(error, KeyboardInterrupt):
        return 128 + signal.SIGINT
    return 1


def one_line(error: BaseException) -> str:
    """What a command prints after `error:` — this package's message as written; for any other exception (a bug, or
    a library's failure nobody foresaw) its type and message, folded onto one line and cut, and where the traceback
    is."""
    if isinstance(error, ScratchTransformerError):
        return str(error)
    message = " ".join(str(error).split())[:500]
    return f"{type(error).__name__}: {message} (run with --debug for the traceback)"


def run_command(program: str, work: Callable[[], int], *, debug: bool) -> int:
    """Run a command's `work` and return its exit status; an error (or Ctrl-C) ends it with `program: error: <one
    line>` on stderr and `exit_code`'s status, or, with `debug`, raises it for the traceback. hf-scratch-translate,
    hf-scratch-export-ct2 and hf-scratch-demo end this way."""
    try:
        return work()
    except KeyboardInterrupt as interrupt:
        return exit_code(interrupt)
    except Exception as error:  # noqa: BLE001  (this package's errors and any other: one line, --debug traceback)
        if debug:
            raise
        print(f"{program}: error: {one_line(error)}", file=sys.stderr)
        return exit_code(error)


@contextmanager
def opened_for_reading(path, what: str, error_class: type[UsageError] = UsageError):
    """`open(path, "rb")` for a file the user named as `what` ("input file", "glossary file"): a missing file, a
    directory or an unreadable one is one `error_class` line naming it."""
    try:
        handle = open(path, "rb")
    except FileNotFoundError:
        raise error_class(f"{what} not found: {os.fspath(path)}") from None
    except IsADirectoryError:
        raise error_class(f"{what} is a directory: {os.fspath(path)}") from None
    except OSError as error:
        raise error_class(f"cannot read {what} {os.fspath(path)}: {error.strerror or error}") from None
    with handle:
        try:
            yield handle
        except IsADirectoryError:  # Linux opens a directory and fails at the first read
            raise error_class(f"{what} is a directory: {os.fspath(path)}") from None
        except OSError as error:
            raise error_class(f"cannot read {what} {os.fspath(path)}: {error.strerror or error}") from None


def write_error(error: OSError, what: str, path) -> UsageError | EnvironmentFault:
    """The one-line error for an OSError writing `what` to `path` (None: standard output): a full disk (or another
    failure of the machine) is an EnvironmentFault, exit 1; a path that cannot be written is the user's to change,
    a UsageError, exit 2."""
    where = f"{what} {path}" if path is not None else what
    if path is not None and not os.path.isabs(path) and not working_directory_exists():
        return UsageError(f"cannot write {where}: the working directory was deleted; give an absolute path")
    if error.errno in (errno.ENOSPC, errno.EDQUOT):
        return EnvironmentFault(f"no space left on device writing {where}: free some space, or write elsewhere")
    reason = error.strerror or str(error)
    if error.errno in (errno.EACCES, errno.EPERM, errno.EROFS, errno.ENAMETOOLONG, errno.ENOTDIR, errno.EISDIR,
                       errno.ENOENT, errno.EEXIST):
        return UsageError(f"cannot write {where}: {reason}; choose another path")
    return EnvironmentFault(f"cannot write {where}: {reason}")


def print_results(text: str, saved_in) -> None:
    """Print a command's closing `text` on standard output. A reader that has gone (`| head -1`) is not an error:
    nothing more is printed. A stream that cannot be written (`> /dev/full`) is one EnvironmentFault line saying
    that the results are saved in `saved_in` all the same. Either way standard output then points at /dev/null, so
    that what is still buffered cannot fail again when Python exits."""
    if sys.stdout is None:  # started with standard output closed (`>&-`)
        return
    try:
        sys.stdout.write(text + "\n")
        sys.stdout.flush()
    except BrokenPipeError:
        silence_stdout()
    except OSError as error:
        silence_stdout()
        raise EnvironmentFault(f"{write_error(error, 'standard output', None)} (the results are saved in "
                               f"{saved_in} all the same)") from None


def silence_stdout() -> None:
    """Point standard output at /dev/null (its file descriptor: what Python flushes at exit goes nowhere)."""
    try:
        null = os.open(os.devnull, os.O_WRONLY)
        os.dup2(null, sys.stdout.fileno())
        os.close(null)
    except (OSError, ValueError, AttributeError):  # no real file descriptor (a StringIO): nothing is flushed at exit
        pass


def working_directory_exists() -> bool:
    """False when the working directory was deleted (relative paths then lead nowhere)."""
    try:
        os.getcwd()
        return True
    except FileNotFoundError:
        return False


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
