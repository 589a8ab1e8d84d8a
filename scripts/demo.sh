#!/usr/bin/env bash
# The mergefs demo: build a tiny Llama family, index it, plan a 25% expert-read budget, mount the
# merge, load the mount with transformers' from_pretrained, run it, show what was read, unmount.
# Usage: scripts/demo.sh [WORKDIR]   (default: a fresh temporary directory)
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh test   # from_pretrained needs torch and transformers
PY=.venv/bin/python

WORK="${1:-$(mktemp -d /tmp/mergefs-demo.XXXXXX)}"
MNT="$WORK/mnt"
mkdir -p "$WORK"
unmount() {
    if grep -qs " $MNT fuse" /proc/self/mountinfo; then
        "$PY" -m mergefs.cli.main umount "$MNT" || fusermount3 -u -z "$MNT" || true
    fi
}
trap unmount EXIT

step() { printf '\n\033[1m== %s\033[0m\n' "$*"; }

step "build a tiny Llama family (base + 3 experts) and its spec"
"$PY" -m mergefs.cli.demo build "$WORK"
cat "$WORK/spec.yaml"

step "mergefs index (one pass over base and experts, reused afterwards)"
"$PY" -m mergefs.cli.main index "$WORK/spec.yaml"

step "mergefs plan (what the 25% budget reads, and its error bound)"
"$PY" -m mergefs.cli.main plan "$WORK/spec.yaml"

step "mergefs mount"
mkdir -p "$MNT"
"$PY" -m mergefs.cli.main mount "$WORK/spec.yaml" "$MNT"
ls -la "$MNT"

step "from_pretrained(mountpoint) and a forward pass"
"$PY" -m mergefs.cli.demo run "$MNT"

step "mergefs stats (bytes read vs full, cache)"
"$PY" -m mergefs.cli.main stats "$MNT"

step "mergefs umount"
"$PY" -m mergefs.cli.main umount "$MNT"

step "mergefs replay (re-read every recorded range, re-merge, check every hash)"
"$PY" -m mergefs.cli.main replay "$WORK/spec.manifest.jsonl"
