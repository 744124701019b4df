"""Every transformers common test (and generation check) that MarianMT passes in this harness passes here too."""

import re
import subprocess
import sys
from pathlib import Path

import pytest

TESTS = Path(__file__).parent


def outcomes(module: str) -> dict[str, str]:
    """{test name: PASSED | FAILED | ERROR} of one module's TestCase, from pytest's -rA summary (skips: absent)."""
    result = subprocess.run(
        [sys.executable, "-m", "pytest", str(TESTS / module), "-q", "-rA", "-p", "no:cacheprovider", "-o", "addopts="],
        capture_output=True, text=True, cwd=TESTS.parent, timeout=1800,
    )
    found = {}
    for status, name in re.findall(r"^(PASSED|FAILED|ERROR) \S+::(\w+)", result.stdout, flags=re.M):
        found[name] = status
    assert found, result.stdout[-3000:] + result.stderr[-3000:]
    return found


@pytest.mark.slow
def test_every_common_test_marian_passes_passes_here():
    marian = outcomes("marian_common_control.py")
    ours = outcomes("test_modeling_transformers_common.py")
    marian_passed = {name for name, status in marian.items() if status == "PASSED"}
    ours_passed = {name for name, status in ours.items() if status == "PASSED"}
    print(f"MarianMT: {len(marian_passed)} passed; this model: {len(ours_passed)} passed, "
          f"{sum(s == 'FAILED' for s in ours.values())} failed")
    assert len(marian_passed) > 100
    assert marian_passed - ours_passed == set(), sorted(marian_passed - ours_passed)
    assert not [name for name, status in ours.items() if status in ("FAILED", "ERROR")]
