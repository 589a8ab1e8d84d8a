#!/usr/bin/env bash
# The mergefs demo: build a tiny Llama family, index it, plan a 25% expert-read budget, mount the
# merge, load the mount with transformers' from_pretrained, run it, show what was read, unmount.
# Usage: scripts/demo.sh [WORKDIR]   (default: a fresh temporary directory)
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh demo   # the mount, torch and transformers (for from_pretrained)
PY=.venv/bin/python

# no third-party progress bars or advice in the demo's output
export TRANSFORMERS_VERBOSITY=error HF_HUB_DISABLE_PROGRESS_BARS=1 TOKENIZERS_PARALLELISM=false \
    HF_HUB_OFFLINE=1 PYTHONWARNINGS=ignore

if [ $# -ge 1 ]; then WORK="$1"; OWN=0; else WORK="$(mktemp -d /tmp/mergefs-demo.XXXXXX)"; OWN=1; fi
MNT="$WORK/mnt"
mkdir -p "$WORK"
finish() {
    if grep -qs " $MNT fuse" /proc/self/mountinfo; then
        "$PY" -m mergefs.cli umount "$MNT" || fusermount3 -u -z "$MNT" || true
    fi
    # a temporary directory of the demo's own is removed; a WORKDIR given is kept to look at
    if [ "$OWN" = 1 ]; then rm -rf "$WORK"; fi
}
trap finish EXIT

step() { printf '\n\033[1m== %s\033[0m\n' "$*"; }

step "build a tiny Llama family (base + 3 experts) and its spec"
"$PY" -m mergefs.cli.demo build "$WORK"
cat "$WORK/spec.yaml"

step "mergefs index (one pass over base and experts, reused afterwards)"
"$PY" -m mergefs.cli index "$WORK/spec.yaml"

step "mergefs plan (what the 25% budget reads, and its error bound)"
"$PY" -m mergefs.cli plan "$WORK/spec.yaml"

step "mergefs mount"
mkdir -p "$MNT"
"$PY" -m mergefs.cli mount "$WORK/spec.yaml" "$MNT"
ls -la "$MNT"

step "from_pretrained(mountpoint) and a forward pass"
"$PY" -m mergefs.cli.demo run "$MNT"

step "mergefs stats (bytes read vs full, cache)"
"$PY" -m mergefs.cli stats "$MNT"

step "mergefs umount"
"$PY" -m mergefs.cli umount "$MNT"

step "mergefs replay (re-read every recorded range, re-merge, check every hash)"
"$PY" -m mergefs.cli replay "$WORK/spec.manifest.jsonl"
