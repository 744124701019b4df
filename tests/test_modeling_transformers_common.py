"""transformers' own common model tests (ModelTesterMixin, ConfigTester) and generation checks, run on this model;
and, marked slow, the parity check: every one of them that MarianMT passes in the same harness passes here too.

The test files come from the installed transformers version's source distribution on PyPI, fetched (once, then
cached) by the `common_tests` fixture: without PyPI the tests are skipped with the reason."""

import pytest
from common_model_tests import make_test_case, run_suite
from transformers_common import CommonTestsUnavailable, load_common_tests


@pytest.fixture(scope="module")
def common_tests():
    try:
        return load_common_tests()
    except CommonTestsUnavailable as error:
        pytest.skip(f"transformers' common tests are not available: {error}")


def test_transformers_common_model_tests_pass(common_tests, subtests):
    outcomes = run_suite(make_test_case(common_tests, "scratch_transformer"))
    assert sum(status == "passed" for status, _ in outcomes.values()) > 100
    for name, (status, detail) in outcomes.items():
        with subtests.test(msg=name):
            if status == "skipped":
                pytest.skip(detail)
            assert status == "passed", detail


@pytest.mark.slow
def test_every_common_test_marian_passes_passes_here(common_tests):
    marian = run_suite(make_test_case(common_tests, "marian"))
    ours = run_suite(make_test_case(common_tests, "scratch_transformer"))
    marian_passed = {name for name, (status, _) in marian.items() if status == "passed"}
    ours_passed = {name for name, (status, _) in ours.items() if status == "passed"}
    print(f"MarianMT: {len(marian_passed)} passed, {sum(s == 'skipped' for s, _ in marian.values())} skipped; "
          f"this model: {len(ours_passed)} passed, {sum(s == 'skipped' for s, _ in ours.values())} skipped")
    assert len(marian_passed) > 100
    assert marian_passed - ours_passed == set(), sorted(marian_passed - ours_passed)
    assert not [name for name, (status, _) in ours.items() if status == "failed"]
