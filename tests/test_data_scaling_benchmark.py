"""The data-scaling benchmark's code path on a tiny corpus (the figures themselves come from
`python benchmarks/data_scaling.py`, see docs/data.md)."""

import json


def test_quick_mode_times_every_phase_and_the_second_run_reuses_the_datasets_cache(tmp_path):
    from data_scaling import main

    results = main(["--quick", "--work", str(tmp_path / "work"), "--output", str(tmp_path / "scaling.json")])
    first, second = results["rows"]
    assert (first["run"], second["run"], first["pairs"]) == ("first", "second", 2000)
    for row in (first, second):
        assert row["exit_code"] == 0
        assert all(row[phase] is not None and row[phase] >= 0 for phase in
                   ("load_s", "tokenizer_s", "preprocess_s", "setup_s", "first_step_s"))
        assert row["peak_rss_mib"] > 0
    assert first["cache_mib"] > 0 and second["cache_mib"] == first["cache_mib"]  # nothing rewritten: reused
    assert json.loads((tmp_path / "scaling.json").read_text())["rows"] == results["rows"]
    assert "| 2,000 | plain | map | second |" in (tmp_path / "scaling.md").read_text()
