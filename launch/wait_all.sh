# Sourced by the launchers: `wait_all PID...` waits for every process; as soon as one exits
# with a non-zero status, it stops the others (SIGTERM: each saves and stops; SIGKILL after
# 60 s) and returns that status; else 0 once all have finished.
wait_all() {
  local running=("$@") finished code pid alive remaining
  while [ "${#running[@]}" -gt 0 ]; do
    finished=""
    set +e
    wait -n -p finished "${running[@]}"
    code=$?
    set -e
    [ -n "$finished" ] || return 0
    remaining=()
    for pid in "${running[@]}"; do [ "$pid" = "$finished" ] || remaining+=("$pid"); done
    running=("${remaining[@]}")
    if [ "$code" -ne 0 ]; then
      echo "rlx launch: process $finished exited with status $code; stopping the others" >&2
      for pid in "${running[@]}"; do kill -TERM "$pid" 2>/dev/null || true; done
      for _ in $(seq 600); do
        alive=0
        for pid in "${running[@]}"; do kill -0 "$pid" 2>/dev/null && alive=1; done
        [ "$alive" -eq 1 ] || break
        sleep 0.1
      done
      for pid in "${running[@]}"; do kill -KILL "$pid" 2>/dev/null || true; done
      return "$code"
    fi
  done
  return 0
}
