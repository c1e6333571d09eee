#!/usr/bin/env bash
# Airflow on the embedded default profile, one command:
#
#   bash scripts/airflow.sh         # start everything, print the UI URL and login; Ctrl-C stops
#   bash scripts/airflow.sh --help  # this text
#
# Starts the embedded Kafka-protocol broker (unless one already answers on its port, or
# KAFKA_BOOTSTRAP_SERVERS names another Kafka, which the jobs then use) and Airflow's
# components -- api-server, scheduler, dag-processor, triggerer -- bound to 127.0.0.1, on
# SQLite with the LocalExecutor and low parallelism. AIRFLOW_HOME is var/airflow unless already
# set (it holds the database, the logs and the passwords file);
# the DAGs and plugins are this repository's. The UI user is "admin" with a generated password
# (SimpleAuthManager's passwords file, mode 600), printed once, on the first start; there is
# no fixed default. The DAGs' SparkSubmitOperators get the spark_default connection
# from AIRFLOW_CONN_SPARK_DEFAULT (local[*]), set here, never in a DAG file.
#
# Sourced (as scripts/demo.sh does), it only defines airflow_start / _banner / _stop.
#
# Environment: AIRFLOW_PORT (8080), CLICKSTREAM_BROKER_PORT (9092), KAFKA_BOOTSTRAP_SERVERS
# (127.0.0.1:$CLICKSTREAM_BROKER_PORT), and every CLICKSTREAM_* variable, passed on to the
# jobs. Logs: $AIRFLOW_HOME/logs/<component>.log.

REPO="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"

_airflow_env() {
  export PATH="$REPO/.venv/bin:$PATH"  # airflow, clickstream, and pyspark's spark-submit
  export AIRFLOW_HOME="${AIRFLOW_HOME:-$REPO/var/airflow}"
  AIRFLOW_PORT="${AIRFLOW_PORT:-8080}"
  BROKER_PORT="${CLICKSTREAM_BROKER_PORT:-9092}"
  export KAFKA_BOOTSTRAP_SERVERS="${KAFKA_BOOTSTRAP_SERVERS:-127.0.0.1:$BROKER_PORT}"
  export AIRFLOW__CORE__DAGS_FOLDER="$REPO/dags"
  export AIRFLOW__CORE__PLUGINS_FOLDER="$REPO/plugins"
  export AIRFLOW__CORE__LOAD_EXAMPLES=False
  export AIRFLOW__CORE__EXECUTOR=LocalExecutor
  export AIRFLOW__CORE__PARALLELISM=4
  export AIRFLOW__CORE__MAX_ACTIVE_TASKS_PER_DAG=2
  export AIRFLOW__CORE__DAGS_ARE_PAUSED_AT_CREATION=False
  export AIRFLOW__DATABASE__SQL_ALCHEMY_CONN="sqlite:///$AIRFLOW_HOME/airflow.db"
  export AIRFLOW__API__HOST=127.0.0.1
  export AIRFLOW__API__PORT="$AIRFLOW_PORT"
  export AIRFLOW__API__BASE_URL="http://127.0.0.1:$AIRFLOW_PORT"
  export AIRFLOW__CORE__EXECUTION_API_SERVER_URL="http://127.0.0.1:$AIRFLOW_PORT/execution/"
  export AIRFLOW__CORE__SIMPLE_AUTH_MANAGER_USERS=admin:admin
  export AIRFLOW__CORE__SIMPLE_AUTH_MANAGER_ALL_ADMINS=False
  export AIRFLOW__CORE__SIMPLE_AUTH_MANAGER_PASSWORDS_FILE="$AIRFLOW_HOME/simple_auth_manager_passwords.json.generated"
  export AIRFLOW__DAG_PROCESSOR__REFRESH_INTERVAL=30
  # spark://local[*] (URL-encoded): the SparkSubmitHook turns host "local[*]" into --master.
  export AIRFLOW_CONN_SPARK_DEFAULT="${AIRFLOW_CONN_SPARK_DEFAULT:-spark://local%5B%2A%5D}"
  AIRFLOW_LOGS="$AIRFLOW_HOME/logs"
  AIRFLOW_URL="http://127.0.0.1:$AIRFLOW_PORT"
  AIRFLOW_PASSWORD_FILE="$AIRFLOW__CORE__SIMPLE_AUTH_MANAGER_PASSWORDS_FILE"
}

_port_open() {  # _port_open PORT -> 0 when something listens on 127.0.0.1:PORT
  "$REPO/.venv/bin/python" - "$1" <<'EOF'
import socket, sys
with socket.socket() as s:
    s.settimeout(0.5)
    sys.exit(0 if s.connect_ex(("127.0.0.1", int(sys.argv[1]))) == 0 else 1)
EOF
}

_uses_embedded_broker() {  # 0 when the jobs' Kafka is the embedded broker's port (after _airflow_env)
  case "$KAFKA_BOOTSTRAP_SERVERS" in
    "127.0.0.1:$BROKER_PORT" | "localhost:$BROKER_PORT") return 0 ;;
    *) return 1 ;;
  esac
}

# A new embedded broker starts empty, with new topic ids: a sessionizer checkpoint from an earlier
# broker names offsets of a log that is gone, and the sessionizer stops on it (DataLossError,
# not retried; the DAG pauses after 6 failed runs). Said once, here, rather than found later.
_warn_if_checkpoint_outlives_broker() {
  local home="${CLICKSTREAM_HOME:-$REPO/var/home}"  # config.py's default: the repository's
  local checkpoint="$home/checkpoints/sessionize"
  # Only a checkpoint that read offsets, and only when the jobs use this broker.
  compgen -G "$checkpoint/offsets/[0-9]*" >/dev/null || return 0
  _uses_embedded_broker || return 0
  cat >&2 <<EOF
airflow: warning: the embedded broker starts empty (it keeps its data in memory only), but the
  sessionizer's checkpoint $checkpoint holds offsets read from an earlier broker.
  The sessionizer DAG will fail with DataLossError (not retried) and pause after 6 runs.
  To start over: stop, then delete $home and ${CLICKSTREAM_WAREHOUSE:-$REPO/var/warehouse} (or set
  CLICKSTREAM_HOME and CLICKSTREAM_WAREHOUSE to new folders), and start again. To keep the
  tables: delete only $checkpoint, run 'clickstream republish' (the new broker's sessions and
  attributions topics are empty: every job refuses them until the tables are published there
  again), then 'clickstream recompute --full --client C' for each client whose sessions were open.
EOF
}

_STARTED_PIDS=()

_start() {  # _start NAME COMMAND... : in its own session, so stopping it stops its children
  local name=$1 monitor=0; shift
  # With job control on (sourced in an interactive shell) a background job leads its own
  # process group, and setsid then forks: $! would not be the session airflow_stop stops.
  case $- in *m*) monitor=1; set +m ;; esac
  setsid "$@" >"$AIRFLOW_LOGS/$name.log" 2>&1 < /dev/null &
  _STARTED_PIDS+=("$!")
  if [ "$monitor" = 1 ]; then set -m; fi
}

airflow_start() {
  _airflow_env
  mkdir -p "$AIRFLOW_LOGS"
  if _port_open "$AIRFLOW_PORT"; then
    echo "airflow: port $AIRFLOW_PORT is in use; set AIRFLOW_PORT" >&2; return 1
  fi
  echo "== Airflow: metadata DB in $AIRFLOW_HOME (log: $AIRFLOW_LOGS/db-migrate.log)"
  airflow db migrate >"$AIRFLOW_LOGS/db-migrate.log" 2>&1 || {
    tail -20 "$AIRFLOW_LOGS/db-migrate.log" >&2; return 1; }
  AIRFLOW_NEW_PASSWORD="$(python "$REPO/scripts/airflow_password.py" --file "$AIRFLOW_PASSWORD_FILE")"

  if ! _uses_embedded_broker; then
    echo "== embedded broker not started: the jobs use KAFKA_BOOTSTRAP_SERVERS=$KAFKA_BOOTSTRAP_SERVERS"
  elif ! _port_open "$BROKER_PORT"; then
    echo "== embedded broker on 127.0.0.1:$BROKER_PORT (log: $AIRFLOW_LOGS/broker.log)"
    _warn_if_checkpoint_outlives_broker
    _start broker clickstream broker --port "$BROKER_PORT"
    local broker_pid=${_STARTED_PIDS[-1]}
    for _ in $(seq 1 100); do
      grep -q "^embedded broker ready on" "$AIRFLOW_LOGS/broker.log" 2>/dev/null && break
      if ! kill -0 "$broker_pid" 2>/dev/null; then  # it stopped: say why, start nothing more
        echo "airflow: the embedded broker did not start:" >&2
        tail -5 "$AIRFLOW_LOGS/broker.log" >&2
        return 1
      fi
      sleep 0.1
    done
  fi

  echo "== Airflow components on 127.0.0.1 (logs: $AIRFLOW_LOGS/<component>.log)"
  _start api-server airflow api-server --host 127.0.0.1 --port "$AIRFLOW_PORT"
  local api_pid=${_STARTED_PIDS[-1]}
  _start scheduler airflow scheduler --skip-serve-logs
  _start dag-processor airflow dag-processor
  _start triggerer airflow triggerer --skip-serve-logs
  for _ in $(seq 1 180); do
    curl -fsS "$AIRFLOW_URL/api/v2/monitor/health" >/dev/null 2>&1 && break
    if ! kill -0 "$api_pid" 2>/dev/null; then  # it stopped: say why, wait no longer
      echo "airflow: the API server stopped; see $AIRFLOW_LOGS/api-server.log" >&2
      tail -20 "$AIRFLOW_LOGS/api-server.log" >&2
      return 1
    fi
    sleep 1
  done
  curl -fsS "$AIRFLOW_URL/api/v2/monitor/health" >/dev/null 2>&1 || {
    echo "airflow: the API server did not come up; see $AIRFLOW_LOGS/api-server.log" >&2
    tail -20 "$AIRFLOW_LOGS/api-server.log" >&2; return 1; }
}

airflow_banner() {
  echo
  echo "================================================================================"
  echo " Airflow UI:  $AIRFLOW_URL      user: admin"
  if [ -n "${AIRFLOW_NEW_PASSWORD:-}" ]; then
    echo " password:    $AIRFLOW_NEW_PASSWORD   (generated now and shown only this once;"
    echo "              it stays in $AIRFLOW_PASSWORD_FILE, mode 600)"
  else
    echo " password:    generated on the first start; read it from"
    echo "              $AIRFLOW_PASSWORD_FILE"
  fi
  echo " Quality reports: the 'Quality reports' entry of the UI's navigation"
  echo "================================================================================"
}

airflow_stop() {
  local pid sid pids
  for pid in "${_STARTED_PIDS[@]}"; do
    # Each component runs in the session it created (setsid): its pid is the session id.
    # Task processes (and their Spark JVMs) stay in that session, so they are stopped too.
    sid=$pid
    # ps fails when the session is already empty: not an error (set -e, pipefail).
    pids=$(ps -o pid= -s "$sid" 2>/dev/null | tr '\n' ' ' || true)
    # shellcheck disable=SC2086  # $pids: one argument per pid
    if [ -n "${pids// /}" ]; then kill -TERM $pids 2>/dev/null || true; fi
  done
  for _ in $(seq 1 30); do
    pids=""
    for sid in "${_STARTED_PIDS[@]}"; do pids+=$(ps -o pid= -s "$sid" 2>/dev/null || true); done
    [ -z "${pids// /}" ] && break
    sleep 0.5
  done
  for sid in "${_STARTED_PIDS[@]}"; do
    pids=$(ps -o pid= -s "$sid" 2>/dev/null | tr '\n' ' ' || true)
    # shellcheck disable=SC2086  # $pids: one argument per pid
    if [ -n "${pids// /}" ]; then kill -KILL $pids 2>/dev/null || true; fi
  done
  _STARTED_PIDS=()
  return 0
}

if [ "${BASH_SOURCE[0]}" = "$0" ]; then
  set -euo pipefail
  if [ $# -gt 0 ]; then  # before anything starts: it takes no arguments but --help
    case "$1" in
      # The header comment above, without its '#'.
      -h|--help) sed -n '1d; /^#/!q; s/^# \{0,1\}//p' "$0"; exit 0 ;;
      *) echo "airflow.sh: unknown argument '$1'; it takes none (--help for usage)" >&2; exit 2 ;;
    esac
  fi
  cd "$REPO"
  bash scripts/setup.sh
  trap 'echo; echo "== stopping"; airflow_stop' EXIT
  trap 'exit 130' INT TERM
  airflow_start
  airflow_banner
  echo "Running until Ctrl-C."
  while true; do sleep 2; done
fi
