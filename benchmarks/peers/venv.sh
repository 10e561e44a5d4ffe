# Sourced by benchmarks/peers/<name>/setup.sh: the benchmark-only venv of one peer.
#
#     source "$(dirname "$0")/../venv.sh"; peer_venv NAME
#
# sets root, venv (benchmarks/.venv-NAME, created with ${PYTHON:-python3} if missing), stamp
# ($venv/.lmtail-ready), pin (a constraint file holding torch==2.13.0, the CPU build) and
# pip (an array: "$venv/bin/pip" install -q -c "$pin"), so nothing a peer installs can
# replace torch. Exits 0 (the whole setup) when the stamp is newer than the calling script.
peer_venv() {
    root="$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)"
    venv="$root/benchmarks/.venv-$1"
    stamp="$venv/.lmtail-ready"
    if [ -f "$stamp" ] && [ "$stamp" -nt "$0" ]; then
        echo "benchmarks/.venv-$1 already set up"
        exit 0
    fi
    [ -x "$venv/bin/python" ] || "${PYTHON:-python3}" -m venv "$venv"
    pin="$venv/torch-pin.txt"
    echo "torch==2.13.0" > "$pin"
    pip=("$venv/bin/pip" install -q -c "$pin")
}
