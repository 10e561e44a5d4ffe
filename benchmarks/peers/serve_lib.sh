# Shared by the peers' serve.sh scripts (sourced): stop_group PIDFILE NAME ends the process
# group whose id PIDFILE holds (TERM, up to 30 s, then KILL) and removes the file.
stop_group() {
    local pidf="$1" name="$2" pgid
    [ -f "$pidf" ] || return 0
    pgid="$(cat "$pidf")"
    if kill -0 -- "-$pgid" 2>/dev/null; then
        kill -TERM -- "-$pgid" 2>/dev/null || true
        for _ in $(seq 1 30); do kill -0 -- "-$pgid" 2>/dev/null || break; sleep 1; done
        kill -KILL -- "-$pgid" 2>/dev/null || true
    fi
    rm -f "$pidf"
    echo "$name (process group $pgid) stopped"
}
