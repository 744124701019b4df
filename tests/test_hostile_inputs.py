"""Every case of scripts/hostile_inputs.py, one test each: exit status, a one-line message naming the value."""


import pytest

import hostile_inputs


@pytest.fixture(scope="module")
def workspace(tmp_path_factory):
    import torch

    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # tiny models on shared cores
    yield hostile_inputs.Workspace(tmp_path_factory.mktemp("hostile"))
    torch.set_num_threads(threads)


@pytest.mark.parametrize("case", hostile_inputs.all_cases(), ids=lambda case: f"{case.category}-{case.name}")
def test_hostile_case_is_handled_cleanly(case, workspace):
    try:
        case.check(workspace)
    except hostile_inputs.Skipped as reason:
        pytest.skip(str(reason))


def test_every_issue_category_has_cases():
    cases = hostile_inputs.all_cases()
    categories = {case.category for case in cases}
    assert categories >= {"flags", "config", "corpus", "output", "resume", "launch", "loading", "inference", "faults"}
    assert len({case.name for case in cases}) == len(cases)


def test_the_script_counts_and_a_broken_case_counts_as_not_clean(capsys, tmp_path):
    assert hostile_inputs.main(["-k", "negative_warmup"]) == 0
    assert capsys.readouterr().out.strip().splitlines()[-1] == "1 hostile cases tried: 1 handled cleanly"
    # a check that expects a word the message lacks is reported, not counted
    wrong = hostile_inputs.flag_case("wrong_expectation", {"warmup_steps": -5}, "no such words")
    clean, failures = hostile_inputs.run_cases([wrong], tmp_path, verbose=False)
    assert clean == 0 and "does not name ['no such words']" in failures[0][1]
