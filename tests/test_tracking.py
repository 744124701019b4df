"""tracking.py: TensorBoard's writer thread failing on a real full disk ends in one line on the main thread, without
its traceback; the thread hook that drops it lives only as long as the trackers, and passes every other thread's
error on. (The whole run on a full or read-only runs/ folder: scripts/hostile_cases/environment.py.)"""

import threading
import time

import pytest
from accelerate import Accelerator
from tmpfs import small_tmpfs

from hf_scratch_transformer.errors import TrainingFault
from hf_scratch_transformer.training.tracking import end_tracker_logs, log_to_trackers, start_tracker_logs


@pytest.fixture
def recorded_thread_errors():
    """threading.excepthook replaced by one that records what reaches it (the hook the trackers' hook passes to)."""
    previous, seen = threading.excepthook, []
    threading.excepthook = seen.append
    yield seen
    threading.excepthook = previous


def writer_threads() -> list[threading.Thread]:
    return [thread for thread in threading.enumerate() if type(thread).__name__ == "_AsyncWriterThread"]


def test_a_full_disk_under_the_logs_is_one_line_and_the_writer_thread_prints_nothing(tmp_path, recorded_thread_errors):
    recorder = threading.excepthook
    accelerator = Accelerator(log_with="tensorboard", project_dir=str(tmp_path))
    with small_tmpfs(tmp_path / "runs", 64):  # room for the files the trackers open, not for what is logged
        start_tracker_logs(accelerator, {"preset": "tiny"})
        assert threading.excepthook is not recorder
        writers = writer_threads()
        assert writers
        deadline = time.monotonic() + 60
        with pytest.raises(TrainingFault) as fault:  # the writer's error, handed to the main thread's next log call
            step = 0
            while time.monotonic() < deadline:
                values = {"loss": float(step), "sample": f"translation {step}: " + "x" * 2000}
                log_to_trackers(accelerator, values, step)
                step += 1
        for thread in writers:
            thread.join(10)
        assert f"could not write the tensorboard logs in {tmp_path / 'runs'}" in str(fault.value)
        assert "No space left on device" in str(fault.value)
        assert recorded_thread_errors == []  # the writer thread's OSError was dropped, not printed
        with pytest.raises(TrainingFault):
            end_tracker_logs(accelerator)  # the files cannot be closed either
    assert threading.excepthook is recorder


def test_while_trackers_run_other_threads_errors_reach_the_previous_hook(tmp_path, recorded_thread_errors):
    recorder = threading.excepthook
    accelerator = Accelerator(log_with="tensorboard", project_dir=str(tmp_path))
    start_tracker_logs(accelerator, {"preset": "tiny"})
    assert threading.excepthook is not recorder
    for error in (ValueError("a bug in another thread"), OSError("another thread's failed write")):
        def fail(error=error):
            raise error

        thread = threading.Thread(target=fail)
        thread.start()
        thread.join()
    log_to_trackers(accelerator, {"loss": 1.0}, 1)
    end_tracker_logs(accelerator)
    assert threading.excepthook is recorder
    assert [str(hook_args.exc_value) for hook_args in recorded_thread_errors] == [
        "a bug in another thread", "another thread's failed write"]
    assert list((tmp_path / "runs").iterdir())  # the logs were written
