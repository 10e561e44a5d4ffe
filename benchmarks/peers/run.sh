#!/usr/bin/env bash
# Peer benchmarks: lmtail against other software, each peer in its own benchmark-only venv.
#
#     benchmarks/peers/run.sh [NAME ...]        (default: every peer; `make bench-peers`)
#
# A peer is a folder benchmarks/peers/<name>/ holding setup.sh (builds benchmarks/.venv-<name>)
# and bench.py (run with that venv's python from the repository root). The venv is set up on
# first use; when setup fails (no network, no wheel for this machine) the peer is skipped with
# a SKIP line saying why and where the log is. After every peer, the peer table
# (benchmarks/peers/table.py, run with lmtail's .venv: lmtail vs llama.cpp and vLLM, every row
# measured; docs/peers.md) runs with the table peers named (llamacpp, vllm); lmtail's own arm
# always runs, a peer that cannot start prints SKIP in the table's output.
# Knobs (environment): TABLE_ARGS (passed to table.py, e.g. "--quick" or "--rounds 6"),
# TABLE=0 (no table), PEER_BENCHES=0 (set up the venvs but skip each peer's own bench.py).
# Exit status: 0 when every peer ran or was skipped, 1 when a peer's bench.py or the table failed.
set -uo pipefail
here="$(cd "$(dirname "$0")" && pwd)"
root="$(cd "$here/../.." && pwd)"
cd "$root"
names=("$@")
if [ ${#names[@]} -eq 0 ]; then
    for d in "$here"/*/; do
        [ -f "$d/setup.sh" ] && names+=("$(basename "$d")")
    done
fi
failed=0
table_peers=()
for name in "${names[@]}"; do
    dir="$here/$name"
    if [ ! -f "$dir/setup.sh" ] || [ ! -f "$dir/bench.py" ]; then
        echo "SKIP $name: benchmarks/peers/$name needs setup.sh and bench.py"
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
            echo "SKIP $name: setup failed (last lines of ${log#$root/}):"
            tail -n 5 "$log" | sed 's/^/    /'
            continue
        fi
    fi
    case "$name" in llamacpp|vllm) table_peers+=("$name") ;; esac
    [ "${PEER_BENCHES:-1}" = 0 ] && continue
    echo "== peer $name: benchmarks/peers/$name/bench.py"
    if ! "$venv/bin/python" "$dir/bench.py"; then
        echo "peer $name: bench.py failed"
        failed=1
    fi
done
if [ "${TABLE:-1}" != 0 ]; then
    # the table asks for every named table peer: one whose setup was skipped above prints SKIP there too
    want=()
    for name in "${names[@]}"; do
        case "$name" in llamacpp|vllm) want+=("$name") ;; esac
    done
    echo "== peer table: benchmarks/peers/table.py ${TABLE_ARGS:-} (set up: ${table_peers[*]:-none})"
    # shellcheck disable=SC2086
    if ! "$root/.venv/bin/python" "$here/table.py" --peers ${want[@]+"${want[@]}"} ${TABLE_ARGS:-}; then
        echo "peer table: table.py failed"
        failed=1
    fi
fi
exit $failed
