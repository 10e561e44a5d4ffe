#!/usr/bin/env bash
# Peer benchmarks: lmtail against other software, each peer in its own benchmark-only venv.
#
#     benchmarks/peers/run.sh [NAME ...]        (default: every peer; `make bench-peers`)
#
# A peer is a folder benchmarks/peers/<name>/ holding setup.sh (builds benchmarks/.venv-<name>)
# and bench.py (run with that venv's python from the repository root). The venv is set up on
# first use; when setup fails (no network, no wheel for this machine) the peer is skipped with
# a line saying why and where the log is. Exit status: 0 when every peer ran or was skipped,
# 1 when a peer's bench.py failed.
set -uo pipefail
here="$(cd "$(dirname "$0")" && pwd)"
root="$(cd "$here/../.." && pwd)"
cd "$root"
names=("$@")
if [ ${#names[@]} -eq 0 ]; then
    for d in "$here"/*/; do
        names+=("$(basename "$d")")
    done
fi
failed=0
for name in "${names[@]}"; do
    dir="$here/$name"
    if [ ! -f "$dir/setup.sh" ] || [ ! -f "$dir/bench.py" ]; then
        echo "skip $name: benchmarks/peers/$name needs setup.sh and bench.py"
        continue
    fi
    venv="$root/benchmarks/.venv-$name"
    stamp="$venv/.peer-ready"
    log="$venv/setup.log"
    if [ ! -f "$stamp" ] || [ "$dir/setup.sh" -nt "$stamp" ]; then
        mkdir -p "$venv"
        echo "== peer $name: setting up benchmarks/.venv-$name (log: ${log#$root/})"
        if bash "$dir/setup.sh" >"$log" 2>&1; then
            touch "$stamp"
        else
            echo "skip $name: setup failed (last lines of ${log#$root/}):"
            tail -n 5 "$log" | sed 's/^/    /'
            continue
        fi
    fi
    echo "== peer $name: benchmarks/peers/$name/bench.py"
    if ! "$venv/bin/python" "$dir/bench.py"; then
        echo "peer $name: bench.py failed"
        failed=1
    fi
done
exit $failed
