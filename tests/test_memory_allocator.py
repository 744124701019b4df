"""train.py runs on tcmalloc when the machine has it (memory_allocator.py): the process executes itself again, once,
with tcmalloc preloaded, keeping its pid, arguments and environment; a user's own malloc and the opt-out are kept; a
library that cannot be preloaded does not make it loop. The relaunch is exercised for real, in subprocesses, with a
stand-in library (a copy of this interpreter's libm named as tcmalloc), so it is tested on machines without
tcmalloc; the last tests run the real train.py on whatever this machine has."""

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from hf_scratch_transformer import memory_allocator
from hf_scratch_transformer.memory_allocator import (
    ALLOCATOR_VARIABLE,
    RELAUNCHED_VARIABLE,
    describe_allocator,
    find_tcmalloc,
    loaded_allocator,
)

from helpers import REPO, quick_flags

pytestmark = pytest.mark.skipif(sys.platform != "linux", reason="LD_PRELOAD and /proc/self/maps are Linux's")

MODULE = Path(memory_allocator.__file__)
# Loads the module from its file as train.py does (no torch import), relaunches, then reports what it runs on.
PROGRAM = f"""
import importlib.util, os, sys
from pathlib import Path
spec = importlib.util.spec_from_file_location("allocator", {str(MODULE)!r})
allocator = importlib.util.module_from_spec(spec)
spec.loader.exec_module(allocator)
print("start", os.getpid(), flush=True)
allocator.relaunch_for_training(search_dirs=[Path(sys.argv[1])])
print("running", os.getpid(), allocator.loaded_allocator(), os.environ.get("LD_PRELOAD"), sys.argv[1:],
      repr(allocator.describe_allocator()), sep="|", flush=True)
"""


def shared_library() -> Path:
    """A real shared library this interpreter has loaded (libm), harmless to preload a second time."""
    for line in Path("/proc/self/maps").read_text().splitlines():
        path = line.split(maxsplit=5)[-1]
        if Path(path).name.startswith("libm.so") or Path(path).name.startswith("libm-"):
            return Path(path)
    pytest.skip("this interpreter has no libm mapped")


def run_program(tmp_path, library_dir: Path, **env) -> tuple[list[str], str]:
    environ = {key: value for key, value in os.environ.items()
               if key not in ("LD_PRELOAD", ALLOCATOR_VARIABLE, RELAUNCHED_VARIABLE)}
    result = subprocess.run([sys.executable, "-c", PROGRAM, str(library_dir), "--flag", "two words"],
                            capture_output=True, text=True, env={**environ, **env}, timeout=120, cwd=tmp_path)
    assert result.returncode == 0, result.stderr
    return result.stdout.splitlines(), result.stderr


@pytest.fixture
def stand_in_tcmalloc(tmp_path) -> Path:
    directory = tmp_path / "libs"
    directory.mkdir()
    shutil.copy(shared_library(), directory / "libtcmalloc_minimal.so.4")
    return directory


def test_the_process_runs_again_once_with_tcmalloc_preloaded_same_pid_and_arguments(tmp_path, stand_in_tcmalloc):
    lines, _ = run_program(tmp_path, stand_in_tcmalloc, LD_PRELOAD="")
    starts = [line for line in lines if line.startswith("start")]
    running = [line.split("|") for line in lines if line.startswith("running")]
    assert len(starts) == 2 and starts[0] == starts[1], lines  # the program began twice, in one process
    assert len(running) == 1
    _, pid, loaded, preload, argv, described = running[0]
    library = str(stand_in_tcmalloc / "libtcmalloc_minimal.so.4")
    assert pid == starts[0].split()[1] and loaded == library and preload == library
    assert argv == repr([str(stand_in_tcmalloc), "--flag", "two words"])
    assert described == repr("libtcmalloc_minimal.so.4 (preloaded by train.py)")


def test_an_existing_preload_is_kept_after_tcmalloc(tmp_path, stand_in_tcmalloc):
    other = tmp_path / "libother.so"
    shutil.copy(shared_library(), other)
    lines, _ = run_program(tmp_path, stand_in_tcmalloc, LD_PRELOAD=str(other))
    running = [line.split("|") for line in lines if line.startswith("running")]
    assert running[0][3] == f"{stand_in_tcmalloc / 'libtcmalloc_minimal.so.4'}:{other}"


def test_a_malloc_the_user_preloaded_is_kept(tmp_path, stand_in_tcmalloc):
    users = tmp_path / "libjemalloc.so.2"
    shutil.copy(shared_library(), users)
    lines, _ = run_program(tmp_path, stand_in_tcmalloc, LD_PRELOAD=str(users))
    assert len([line for line in lines if line.startswith("start")]) == 1
    running = [line.split("|") for line in lines if line.startswith("running")][0]
    assert running[2] == str(users) and running[5] == repr("libjemalloc.so.2 (in LD_PRELOAD)")


def test_the_opt_out_keeps_the_systems_malloc(tmp_path, stand_in_tcmalloc):
    lines, _ = run_program(tmp_path, stand_in_tcmalloc, **{ALLOCATOR_VARIABLE: "system"})
    assert len([line for line in lines if line.startswith("start")]) == 1
    running = [line.split("|") for line in lines if line.startswith("running")][0]
    assert running[2] == "None" and running[5] == repr(f"the system's malloc ({ALLOCATOR_VARIABLE}=system)")


def test_a_library_that_cannot_be_preloaded_does_not_make_it_loop(tmp_path):
    directory = tmp_path / "libs"
    directory.mkdir()
    (directory / "libtcmalloc_minimal.so.4").write_text("not a shared library\n")
    lines, stderr = run_program(tmp_path, directory)
    assert len([line for line in lines if line.startswith("start")]) == 2  # one relaunch, then on without it
    running = [line.split("|") for line in lines if line.startswith("running")]
    assert len(running) == 1 and running[0][2] == "None"
    assert running[0][5] == repr("the system's malloc (tcmalloc was found but could not be preloaded)")

    assert "cannot be preloaded" in stderr  # the dynamic linker's own message


def test_no_tcmalloc_means_no_relaunch(tmp_path):
    (tmp_path / "empty").mkdir()
    lines, _ = run_program(tmp_path, tmp_path / "empty")
    assert len([line for line in lines if line.startswith("start")]) == 1
    running = [line.split("|") for line in lines if line.startswith("running")]
    assert running[0][2] == "None" and running[0][3] == "None"


def test_loaded_allocator_and_find_tcmalloc_read_what_is_there(tmp_path):
    maps = tmp_path / "maps"
    maps.write_text("7f00-7f01 r-xp 00000000 08:01 42   /usr/lib/x86_64-linux-gnu/libc.so.6\n"
                    "7f02-7f03 r-xp 00000000 00:00 0 \n")
    assert loaded_allocator(maps) is None and loaded_allocator(tmp_path / "missing") is None
    maps.write_text(maps.read_text() + "7f04-7f05 r-xp 00000000 08:01 43   /opt/lib/libtcmalloc_minimal.so.4.5.10\n")
    assert loaded_allocator(maps) == "/opt/lib/libtcmalloc_minimal.so.4.5.10"
    assert find_tcmalloc([tmp_path]) is None
    (tmp_path / "libtcmalloc.so.4").write_bytes(b"")
    assert find_tcmalloc([tmp_path]) == str(tmp_path / "libtcmalloc.so.4")


def test_train_py_runs_on_tcmalloc_when_the_machine_has_it_and_says_so(tmp_path):
    """The real train.py on this machine: with tcmalloc installed it is preloaded; without it the run says how to get
    it. Either way train_results.json names what the process ran on, and the opt-out holds."""
    environ = {key: value for key, value in os.environ.items()
               if key not in ("LD_PRELOAD", ALLOCATOR_VARIABLE, RELAUNCHED_VARIABLE)}
    described = {}
    for name, extra in (("default", {}), ("system", {ALLOCATOR_VARIABLE: "system"})):
        flags = quick_flags(tmp_path / name, max_steps=2, eval_steps=0, save_steps=0, do_train=True)
        result = subprocess.run([sys.executable, str(REPO / "train.py"), *flags], capture_output=True, text=True,
                                cwd=REPO, env={**environ, **extra}, timeout=600)
        assert result.returncode == 0, result.stderr[-2000:]
        described[name] = json.loads((tmp_path / name / "train_results.json").read_text())["train_memory_allocator"]
        assert f"memory allocator: {described[name]}" in result.stderr
    if find_tcmalloc() is not None:
        assert described["default"].startswith("libtcmalloc") and described["default"].endswith("(preloaded by train.py)")
    else:
        assert described["default"].startswith("the system's malloc (no tcmalloc found: install it for about 1.1x")
    assert described["system"] == f"the system's malloc ({ALLOCATOR_VARIABLE}=system)"


def test_the_step_budget_follows_the_malloc_really_mapped_into_train_py(tmp_path, stand_in_tcmalloc):
    """The recipe reads the malloc from the libraries mapped into the process (/proc/self/maps): train.py with a
    tcmalloc in LD_PRELOAD (kept as the user's, no relaunch) resolves the tcmalloc step budget where bf16 pays, and
    on the system's malloc the bf16 one."""
    from hf_scratch_transformer.cpu_threads import cpu_bf16_units
    from hf_scratch_transformer.training.recipe import (BF16_CPU_STEP_BUDGET, BF16_TCMALLOC_CPU_STEP_BUDGET,
                                                        DEFAULT_STEP_BUDGET)

    environ = {key: value for key, value in os.environ.items()
               if key not in ("LD_PRELOAD", ALLOCATOR_VARIABLE, RELAUNCHED_VARIABLE)}
    budgets = {}
    for name, extra in (("tcmalloc", {"LD_PRELOAD": str(stand_in_tcmalloc / "libtcmalloc_minimal.so.4")}),
                        ("system", {ALLOCATOR_VARIABLE: "system"})):
        flags = quick_flags(tmp_path / name, max_steps=1, eval_steps=0, save_steps=0, do_train=True, bf16=None,
                            d_model=256)  # the small preset's width, where bf16 pays
        result = subprocess.run([sys.executable, str(REPO / "train.py"), *flags], capture_output=True, text=True,
                                cwd=REPO, env={**environ, **extra}, timeout=600)
        assert result.returncode == 0, result.stderr[-2000:]
        budgets[name] = json.loads((tmp_path / name / "train_results.json").read_text())["recipe"]["step_budget"]
    if cpu_bf16_units() is not None:
        assert budgets == {"tcmalloc": BF16_TCMALLOC_CPU_STEP_BUDGET, "system": BF16_CPU_STEP_BUDGET}
    else:  # fp32: the budget that was measured for it, whatever the malloc
        assert budgets == {"tcmalloc": DEFAULT_STEP_BUDGET, "system": DEFAULT_STEP_BUDGET}


def test_in_this_process_the_description_matches_what_is_mapped():
    described = describe_allocator({})
    if loaded_allocator() is None:
        assert described.startswith("the system's malloc")
    else:
        assert Path(loaded_allocator()).name in described
