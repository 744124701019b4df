"""Which malloc a training process runs on: tcmalloc when the machine has it.

A training step allocates and frees the same few hundred tensors every step, some of them tens of MB (the logits and
their gradient). glibc's malloc serves allocations that large with mmap and gives them back with munmap, so every
step writes to fresh pages and the kernel faults in and zeroes each one. tcmalloc keeps freed memory for the next
step. With the model's own loss, which made fp32 copies of the logits, that was 4-5 million page faults in 150 steps
and tcmalloc trained at 1.32x the tokens/s (an Intel Xeon); since train.py's loss makes none (training/loss.py),
about 0.9 million against tcmalloc's 0.5 million, and tcmalloc trains at 1.07-1.12x (an AMD EPYC; benchmarks/README.md,
"The memory allocator"). Not adopted, measured: glibc's own tunables (mmap and trimming off, huge pages) were faster
over 150 steps but slowed down as a whole run went on, its heap growing; jemalloc's and mimalloc's defaults fault
more than glibc and were not faster.

`train.py` calls `relaunch_for_training()` before it imports torch: when the machine has tcmalloc (Debian and Ubuntu:
`apt install libtcmalloc-minimal4`; Fedora: `gperftools-libs`) and the process does not run on a malloc of its own
choice yet, the process executes itself again with tcmalloc in LD_PRELOAD: same process id, interpreter, arguments
and environment, as `torch.backends.xeon.run_cpu` does with a launcher. Nothing else in the package does this:
importing it changes no process state. HF_SCRATCH_TRANSFORMER_ALLOCATOR=system keeps the system's malloc; a malloc
already in LD_PRELOAD (tcmalloc, jemalloc, mimalloc) is kept as it is.
"""

import ctypes.util
import os
import sys
from pathlib import Path

ALLOCATOR_VARIABLE = "HF_SCRATCH_TRANSFORMER_ALLOCATOR"  # "system": no relaunch
RELAUNCHED_VARIABLE = "HF_SCRATCH_TRANSFORMER_RELAUNCHED"  # set in the relaunched process: never a second time
MALLOC_LIBRARIES = ("tcmalloc", "jemalloc", "mimalloc")  # what counts as a malloc of the user's choice
TCMALLOC_NAMES = ("tcmalloc_minimal", "tcmalloc")
INSTALL_HINT = ("install it for about 1.1x faster training (Debian/Ubuntu: apt install libtcmalloc-minimal4; Fedora: "
                "dnf install gperftools-libs) and train.py uses it")


def loaded_allocator(maps: Path = Path("/proc/self/maps")) -> str | None:
    """The path of the malloc library mapped into this process (tcmalloc, jemalloc, mimalloc), or None: glibc's
    malloc, or no /proc to tell."""
    try:
        lines = maps.read_text().splitlines()
    except OSError:
        return None
    for line in lines:
        fields = line.split(maxsplit=5)  # address, perms, offset, device, inode[, path]
        if len(fields) == 6 and any(f"lib{name}" in Path(fields[5]).name for name in MALLOC_LIBRARIES):
            return fields[5]
    return None


def find_tcmalloc(search_dirs: list[Path] | None = None) -> str | None:
    """tcmalloc's library: the first `libtcmalloc_minimal.so*` / `libtcmalloc.so*` in `search_dirs` when given,
    otherwise what the dynamic linker's cache knows (ctypes.util.find_library); None when there is none."""
    for name in TCMALLOC_NAMES:
        if search_dirs is None:
            found = ctypes.util.find_library(name)
            if found:
                return found
            continue
        for directory in search_dirs:
            matches = sorted(Path(directory).glob(f"lib{name}.so*"))
            if matches:
                return str(matches[0])
    return None


def relaunch_for_training(environ=None, search_dirs: list[Path] | None = None, execve=os.execve) -> None:
    """Execute this process again with tcmalloc in LD_PRELOAD when the machine has it and nothing speaks against it
    (see the module docstring); otherwise return and let the process go on. Call it before anything is printed or
    started: the new image runs the program from the beginning. `search_dirs`: where to look for tcmalloc instead
    of the dynamic linker's cache (tests)."""
    environ = os.environ if environ is None else environ
    if (sys.platform != "linux" or environ.get(ALLOCATOR_VARIABLE, "").strip().lower() == "system"
            or environ.get(RELAUNCHED_VARIABLE) or loaded_allocator() is not None or not sys.executable):
        return
    library = find_tcmalloc(search_dirs)
    if library is None:
        return
    preload = environ.get("LD_PRELOAD", "").strip()
    child = dict(environ, LD_PRELOAD=f"{library}:{preload}" if preload else library, **{RELAUNCHED_VARIABLE: "1"})
    # tcmalloc reports every allocation above 1 GiB on stderr by default; a large vocabulary's logits are one.
    child.setdefault("TCMALLOC_LARGE_ALLOC_REPORT_THRESHOLD", str(1 << 40))
    sys.stdout.flush()
    sys.stderr.flush()
    try:
        execve(sys.executable, [sys.executable, *sys.orig_argv[1:]], child)
    except OSError:  # the interpreter cannot be executed again (a sandbox): go on with the system's malloc
        return


def describe_allocator(environ=None) -> str:
    """The log line and train_results.json's `train_memory_allocator`: the malloc this process runs on, and why."""
    environ = os.environ if environ is None else environ
    library = loaded_allocator()
    if library is not None:
        return f"{Path(library).name} ({'preloaded by train.py' if environ.get(RELAUNCHED_VARIABLE) else 'in LD_PRELOAD'})"
    if environ.get(ALLOCATOR_VARIABLE, "").strip().lower() == "system":
        return f"the system's malloc ({ALLOCATOR_VARIABLE}=system)"
    if environ.get(RELAUNCHED_VARIABLE):
        return "the system's malloc (tcmalloc was found but could not be preloaded)"
    if find_tcmalloc() is not None:
        return "the system's malloc (tcmalloc is installed: train.py preloads it, a process started otherwise does not)"
    return f"the system's malloc (no tcmalloc found: {INSTALL_HINT})"
