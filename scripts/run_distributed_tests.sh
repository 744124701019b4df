#!/usr/bin/env bash
# Every multi-process test, the slow ones included: two machines on this host losing one (SIGKILL, SIGSTOP), a
# --ddp_timeout shorter than validation, resuming a 2-process stream. About 9 minutes on 2 busy CPU cores.
#   scripts/run_distributed_tests.sh              # all of tests/test_distributed.py
#   scripts/run_distributed_tests.sh -k killed    # pytest options pass through
set -euo pipefail
cd "$(dirname "$0")/.."
exec python -m pytest -p no:cacheprovider -m "slow or not slow" --durations=0 tests/test_distributed.py "$@"
