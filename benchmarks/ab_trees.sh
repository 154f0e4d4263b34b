#!/usr/bin/env bash
# Run one benchmark command in a worktree of COMMIT ("before") and in this tree ("after"), one
# after the other, ROUNDS times, so that both sides see the same machine state; prints each run's
# own output under a header. The command runs from the tree's root with that tree first on
# sys.path (this tree's compiled extension is copied into the worktree: csrc/ must be unchanged).
#   bash benchmarks/ab_trees.sh COMMIT ROUNDS benchmarks/prefill.py --threads 2 --lengths 1024 2048
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
commit="$1" rounds="$2"
shift 2
if ! git -C "$ROOT" diff --quiet "$commit" -- csrc setup.py; then
    echo "ab_trees: csrc/ or setup.py differ from $commit: the copied extension would not be its own" >&2
    exit 2
fi
tmp="$(mktemp -d -t ab-trees.XXXXXX)"
trap 'git -C "$ROOT" worktree remove --force "$tmp/before" >/dev/null 2>&1 || true; rm -rf "$tmp"' EXIT
git -C "$ROOT" worktree add -q --detach "$tmp/before" "$commit"
cp "$ROOT"/ridgefill_runtime/_C*.so "$tmp/before/ridgefill_runtime/"
echo "ab_trees: before = $commit, after = $(git -C "$ROOT" rev-parse --short HEAD)$(git -C "$ROOT" diff --quiet || echo ' + uncommitted changes'); load: $(cut -d' ' -f1-3 /proc/loadavg)"
for ((r = 1; r <= rounds; r++)); do
    for side in before after; do
        tree="$ROOT"
        [[ $side == before ]] && tree="$tmp/before"
        echo "=== round $r: $side ($*)"
        (cd "$tree" && PYTHONPATH="$tree" "$ROOT/.venv/bin/python" "$@")
    done
done
