"""Accelerate's trackers (--report_to, TensorBoard by default) logging into output_dir/runs: started with the run's
hyperparameters, given a row at every log, ended when training ends. A failed write of their files (a full disk, a
read-only folder) ends the run in one TrainingFault line (run_directory.guarded_write).

TensorBoard writes from a thread of its own (`_AsyncWriterThread`), which re-raises a failed write, so Python prints
that thread's traceback before the main thread gets the same error at its next log call, where it becomes the one
line. While the trackers run, `threading.excepthook` drops that traceback (an OSError in such a thread; every other
thread's error goes to the hook that was there); `end_tracker_logs` puts the previous hook back, and train.py's
`main` does too when a run fails before its trackers end. Python has no per-thread hook, and the thread is
TensorBoard's, so the scope is the trackers' lifetime.
"""

import threading
from contextlib import contextmanager
from pathlib import Path

from .run_directory import TRACKER_LOGS, guarded_write

_installed_hooks = []  # the hooks start_tracker_logs installed and nothing has removed yet, newest last


@contextmanager
def _writing_tracker_logs(accelerator):
    """A write of the trackers' logs (output_dir/runs): a failure ends in one line."""
    run_dir = Path(accelerator.logging_dir)
    names = ", ".join(str(getattr(kind, "value", kind)) for kind in accelerator.log_with)
    with guarded_write(f"the {names} logs", run_dir / TRACKER_LOGS, run_dir=run_dir):
        yield


def start_tracker_logs(accelerator, config: dict) -> None:
    """Accelerate's trackers (--report_to), logging into output_dir/runs; their writer threads' tracebacks are
    quiet until `end_tracker_logs` (installed before the trackers start: their first write may fail at once)."""
    _quiet_writer_threads()
    try:
        with _writing_tracker_logs(accelerator):
            accelerator.init_trackers(TRACKER_LOGS, config=config)
    except BaseException:
        restore_thread_excepthook()
        raise


def log_to_trackers(accelerator, values: dict, step: int) -> None:
    """`accelerator.log` (a no-op without trackers)."""
    with _writing_tracker_logs(accelerator):
        accelerator.log(values, step=step)


def end_tracker_logs(accelerator) -> None:
    """`accelerator.end_training`: the trackers flush and close their files; `threading.excepthook` is put back."""
    try:
        with _writing_tracker_logs(accelerator):
            accelerator.end_training()
    finally:
        restore_thread_excepthook()


class _QuietWriterThreads:
    """`threading.excepthook` while trackers run: an OSError in a TensorBoard writer thread is dropped (the main
    thread reports it in one line); every other thread's error goes to `previous`."""

    def __init__(self, previous):
        self.previous = previous

    def __call__(self, hook_args) -> None:
        if type(hook_args.thread).__name__ == "_AsyncWriterThread" and isinstance(hook_args.exc_value, OSError):
            return
        self.previous(hook_args)


def _quiet_writer_threads() -> None:
    hook = _QuietWriterThreads(threading.excepthook)
    threading.excepthook = hook
    _installed_hooks.append(hook)


def restore_thread_excepthook() -> None:
    """Put back the `threading.excepthook` that was there before trackers started (each hook this module installed
    is removed; one that another program installed since is left in place)."""
    while _installed_hooks:
        hook = _installed_hooks.pop()
        if threading.excepthook is hook:
            threading.excepthook = hook.previous
