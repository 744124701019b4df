"""errors.py: every error class of the package under one base, and the one map from an error to a command's exit
status that train.py, hf-scratch-translate, hf-scratch-export-ct2 and hf-scratch-demo share. (Each command's
messages and statuses for real failures are tested with the command: test_cli.py, test_ct2.py, test_demo.py,
test_training.py, scripts/hostile_inputs.py.)"""

import errno
import importlib
import inspect
import pkgutil
import signal

import pytest

import hf_scratch_transformer
from hf_scratch_transformer.errors import (
    EnvironmentFault,
    RunInterrupted,
    ScratchTransformerError,
    TrainingFault,
    UsageError,
    exit_code,
    one_line,
    write_error,
)

EXPECTED = {  # every exception class the package defines: its module and exit status
    "errors.ScratchTransformerError": 1, "errors.UsageError": 2, "errors.EnvironmentFault": 1,
    "errors.TrainingFault": 1, "errors.RunInterrupted": None,  # 128 + the signal, per instance
    "data.corpus_files.CorpusError": 2, "data.corpus_files.CorpusFileNotFoundError": 2,
    "data.corpus_files.CorpusKeyError": 2, "data.loading.DatasetsCacheError": 1,
    "translation_core.InvalidOption": 2, "translation.translate.ModelLoadError": 2,
    "translation.cli.StdoutClosed": 0, "translation.ct2_backend.CT2Error": 2,
    "translation.ct2_backend.CT2NotInstalledError": 2, "export.ct2.CT2ExportError": 2,
    "documents.SegmenterMissing": 2, "glossary.GlossaryError": 2, "protected_spans.ProtectError": 2,
}


def package_exception_classes() -> dict[str, type]:
    """{module.Class (without the package prefix): class} of every exception class defined in the package."""
    found = {}
    prefix = "hf_scratch_transformer."
    for info in pkgutil.walk_packages(hf_scratch_transformer.__path__, prefix):
        module = importlib.import_module(info.name)
        for name, value in vars(module).items():
            if inspect.isclass(value) and issubclass(value, BaseException) and value.__module__ == module.__name__:
                found[f"{module.__name__.removeprefix(prefix)}.{name}"] = value
    return found


def test_every_exception_class_of_the_package_derives_from_the_one_base():
    found = package_exception_classes()
    assert set(found) == set(EXPECTED)
    assert [name for name, cls in found.items() if not issubclass(cls, ScratchTransformerError)] == []
    assert {name: cls.exit_code for name, cls in found.items() if EXPECTED[name] is not None} == {
        name: status for name, status in EXPECTED.items() if status is not None}


def test_the_historical_base_types_still_match():
    """Library callers that caught ValueError, RuntimeError, ImportError, FileNotFoundError or KeyError still do."""
    found = package_exception_classes()
    for name, historical in (("translation_core.InvalidOption", ValueError),
                             ("translation.translate.ModelLoadError", RuntimeError),
                             ("translation.ct2_backend.CT2Error", ValueError),
                             ("translation.ct2_backend.CT2NotInstalledError", ImportError),
                             ("data.corpus_files.CorpusFileNotFoundError", FileNotFoundError),
                             ("data.corpus_files.CorpusKeyError", KeyError)):
        assert issubclass(found[name], historical), name


@pytest.mark.parametrize("error, status", [
    (UsageError("a flag"), 2), (EnvironmentFault("a full disk"), 1), (TrainingFault("a NaN"), 1),
    (RunInterrupted("SIGTERM", signal.SIGTERM), 143), (RunInterrupted("SIGINT", signal.SIGINT), 130),
    (KeyboardInterrupt(), 130), (ZeroDivisionError("a bug"), 1),
])
def test_exit_code(error, status):
    assert exit_code(error) == status


def test_one_line_keeps_the_package_messages_and_names_any_other_error():
    assert one_line(UsageError("--port must be between 1 and 65535, got 70000")) == (
        "--port must be between 1 and 65535, got 70000")
    assert one_line(ZeroDivisionError("division\n  by zero")) == (
        "ZeroDivisionError: division by zero (run with --debug for the traceback)")
    assert len(one_line(RuntimeError("x" * 2000))) < 600


def test_a_write_error_is_the_environment_s_for_a_full_disk_and_the_user_s_for_a_path(tmp_path):
    full = write_error(OSError(errno.ENOSPC, "No space left on device"), "output file", tmp_path / "out.txt")
    assert isinstance(full, EnvironmentFault) and exit_code(full) == 1
    assert str(full) == f"no space left on device writing output file {tmp_path / 'out.txt'}: free some space, or " \
                        f"write elsewhere"
    refused = write_error(OSError(errno.EROFS, "Read-only file system"), "output file", tmp_path / "out.txt")
    assert isinstance(refused, UsageError) and exit_code(refused) == 2
    assert str(refused).endswith("Read-only file system; choose another path")
    broken = write_error(OSError(errno.EIO, "Input/output error"), "standard output", None)
    assert isinstance(broken, EnvironmentFault) and str(broken) == "cannot write standard output: Input/output error"


# ------------------------------------------------------------------------ a command's closing print (issue 42)
PRINT_RESULTS = ("import sys; from hf_scratch_transformer.errors import print_results, EnvironmentFault\n"
                 "try:\n    print_results('{\"bleu\": 1}\\n' * 20000, 'runs/x/all_results.json')\n"
                 "except EnvironmentFault as error:\n    print(error, file=sys.stderr); sys.exit(1)\n")


def test_results_printed_into_a_closed_pipe_end_quietly():
    import os
    import subprocess
    import sys

    reader, writer = os.pipe()
    os.close(reader)  # `| head -1` that has gone
    done = subprocess.run([sys.executable, "-c", PRINT_RESULTS], stdout=writer, stderr=subprocess.PIPE, text=True)
    os.close(writer)
    assert (done.returncode, done.stderr) == (0, "")


def test_results_printed_into_a_full_device_are_one_line_saying_where_they_are_saved():
    import subprocess
    import sys

    with open("/dev/full", "w") as full:
        done = subprocess.run([sys.executable, "-c", PRINT_RESULTS], stdout=full, stderr=subprocess.PIPE, text=True)
    assert done.returncode == 1 and len(done.stderr.strip().splitlines()) == 1
    assert "standard output" in done.stderr and "saved in runs/x/all_results.json all the same" in done.stderr
