"""Hostile inputs of multi-process runs that fail before any process starts work (the lost-machine and unshared
output directory cases need two launched machines: tests/test_distributed.py)."""

from hostile_inputs import flag_case

CASES = [
    flag_case("ddp_timeout_zero", {"ddp_timeout": 0}, "--ddp_timeout", "0"),
    flag_case("ddp_timeout_negative", {"ddp_timeout": -30}, "--ddp_timeout", "-30"),
    flag_case("ddp_timeout_not_a_number", {"ddp_timeout": "soon"}, "--ddp_timeout", "soon"),
]
