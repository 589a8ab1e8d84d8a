#!/usr/bin/env bash
# Installs everything mergefs needs (apt packages, .venv, package + test extras) and runs the tests.
# Extra arguments go to pytest, e.g. scripts/test.sh -k format -x
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh test
exec .venv/bin/python -m pytest "$@"
