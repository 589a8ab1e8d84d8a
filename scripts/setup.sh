#!/usr/bin/env bash
# Shared set-up for scripts/test.sh and scripts/demo.sh. Idempotent: each step is skipped when done.
#   scripts/setup.sh            runtime only
#   scripts/setup.sh test       runtime + test, remote and ray extras
set -euo pipefail
cd "$(dirname "$0")/.."
EXTRAS="${1:-}"

need_apt=0
for pkg in fuse3 libfuse3-dev pkg-config; do
    dpkg -s "$pkg" >/dev/null 2>&1 || need_apt=1
done
if [ "$need_apt" = 1 ]; then
    echo "[setup] installing apt packages: fuse3 libfuse3-dev pkg-config"
    SUDO=""
    [ "$(id -u)" = 0 ] || SUDO="sudo"
    $SUDO apt-get update -qq
    DEBIAN_FRONTEND=noninteractive $SUDO apt-get install -y -qq fuse3 libfuse3-dev pkg-config >/dev/null
fi

PY="${PYTHON:-python3}"
if [ ! -x .venv/bin/python ]; then
    echo "[setup] creating .venv"
    "$PY" -m venv .venv
    .venv/bin/python -m pip install -q --upgrade pip setuptools wheel
fi

# Re-install only when pyproject.toml changed since the last successful install.
stamp=".venv/.mergefs-installed${EXTRAS:+-$EXTRAS}"
if [ ! -f "$stamp" ] || [ pyproject.toml -nt "$stamp" ]; then
    if [ "$EXTRAS" = test ]; then
        echo "[setup] installing mergefs[test,remote,ray] (torch==2.13.0 CPU build from local disk)"
        # torch first and pinned, so nothing later can pull a different build.
        .venv/bin/python -m pip install -q "torch==2.13.0"
        .venv/bin/python -m pip install -q -e ".[test,remote,ray]"
    else
        echo "[setup] installing mergefs (torch==2.13.0 CPU build from local disk first)"
        .venv/bin/python -m pip install -q "torch==2.13.0"
        .venv/bin/python -m pip install -q -e .
    fi
    touch "$stamp"
fi
