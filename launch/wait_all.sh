# Sourced by the launchers: `wait_all PID...` waits for every process; as soon as one exits
# with a non-zero status, it stops the others (SIGTERM: each saves and stops; SIGKILL after
# 60 s) and returns that status; else 0 once all have finished. A launcher names what a pid
# runs with `RLX_ROLES[pid]="the learner (process 0)"`; the message then says who died, and
# by which signal.
declare -gA RLX_ROLES=()
rlx_describe() {  # rlx_describe PID STATUS: who, and how it ended
  local who="process $1" how="exited with status $2"
  [ -z "${RLX_ROLES[$1]:-}" ] || who="${RLX_ROLES[$1]} (pid $1)"
  if [ "$2" -gt 128 ] && [ "$2" -lt 160 ]; then
    how="was killed: SIG$(kill -l $(($2 - 128)) 2>/dev/null || echo "$(($2 - 128))")"
  fi
  echo "$who $how"
}
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
      echo "rlx launch: $(rlx_describe "$finished" "$code"); stopping the others" >&2
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
