#!/usr/bin/env bash
# Shared set-up for scripts/test.sh and scripts/demo.sh. Idempotent: each step is skipped when done.
#   scripts/setup.sh demo       the demo: the package with the mount, torch and transformers
#   scripts/setup.sh test       the tests: the package with every extra the tests use
# Both need the mount, so both install fuse3 and the headers pyfuse3 builds against (apt).
set -euo pipefail
cd "$(dirname "$0")/.."
KIND="${1:?usage: scripts/setup.sh demo|test}"
case "$KIND" in
    demo) EXTRAS="demo" ;;
    test) EXTRAS="test,remote,ray" ;;
    *) echo "scripts/setup.sh: unknown kind $KIND (demo or test)" >&2; exit 2 ;;
esac

need_apt=0
for pkg in fuse3 libfuse3-dev pkg-config; do
    dpkg -s "$pkg" >/dev/null 2>&1 || need_apt=1
done
if [ "$need_apt" = 1 ]; then
    echo "[setup] installing apt packages for the mount: fuse3 libfuse3-dev pkg-config"
    SUDO=""
    [ "$(id -u)" = 0 ] || SUDO="sudo"
    $SUDO apt-get update -qq
    DEBIAN_FRONTEND=noninteractive $SUDO apt-get install -y -qq fuse3 libfuse3-dev pkg-config >/dev/null
fi

PY="${PYTHON:-python3}"
if [ ! -x .venv/bin/python ]; then
    echo "[setup] creating .venv"
    "$PY" -m venv .venv
    .venv/bin/python -m pip install -q --upgrade pip
fi

# Re-install only when pyproject.toml changed since the last successful install of this kind.
stamp=".venv/.mergefs-installed-$KIND"
if [ ! -f "$stamp" ] || [ pyproject.toml -nt "$stamp" ]; then
    # torch 2.13.0 first, the CPU build on this machine's disk: the tests pin it and the demo
    # takes it, so nothing later pulls another build (mergefs itself never pins torch).
    echo "[setup] installing mergefs[$EXTRAS] (torch==2.13.0 CPU build first)"
    .venv/bin/python -m pip install -q --disable-pip-version-check "torch==2.13.0"
    .venv/bin/python -m pip install -q --disable-pip-version-check -e ".[$EXTRAS]"
    if [ "$KIND" = test ]; then
        # consensus_ta/consensus_ties are compared with mergekitty's own code; its metadata pins
        # torch 2.10 (it would replace the test torch), so it goes in without its dependencies:
        # everything it imports is already here (mergekit's, the same versions or newer)
        .venv/bin/python -m pip install -q --disable-pip-version-check --no-deps "mergekitty==0.3.0"
    fi
    touch "$stamp"
fi
