"""A real small filesystem for the tests of full disks and read-only folders: a tmpfs mounted for the test.

Mounting needs root (CI containers and this project's machines run the suite as root); elsewhere the test is
skipped with the reason. Faking the failure instead (an OSError raised by hand) would not show what the libraries
really raise on a full disk.
"""

import contextlib
import os
import subprocess

import pytest


@contextlib.contextmanager
def small_tmpfs(path, size_kb: int, prepare=None, read_only: bool = False):
    """Mount a tmpfs of `size_kb` KiB on the (new) directory `path`; `prepare(path)` runs before it is remounted
    read-only when `read_only`. Unmounted at the end, whatever happens."""
    if os.geteuid() != 0:
        pytest.skip("mounting a small tmpfs needs root; a real full or read-only filesystem is what is tested")
    os.makedirs(path, exist_ok=True)
    mounted = subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size_kb}k", "tmpfs", str(path)],
                             capture_output=True, text=True)
    if mounted.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here ({mounted.stderr.strip()}): a real full filesystem is what is tested")
    try:
        if prepare is not None:
            prepare(path)
        if read_only:
            subprocess.run(["mount", "-o", "remount,ro", str(path)], check=True, capture_output=True)
        yield path
    finally:
        subprocess.run(["umount", "-l", str(path)], capture_output=True)
