#!/usr/bin/env bash
# The whole embedded stack and a demo a newcomer can follow, one command:
#
#   bash scripts/demo.sh              # everything, then keeps running until Ctrl-C
#   bash scripts/demo.sh --no-airflow # only steps 1-3 (broker, events, sessionizer), then exit
#   bash scripts/demo.sh --help       # this text
#
# 1. the embedded broker; one day of demo events for 3 clients (out of order, duplicates, late
#    and bad records); 2. the sessionizer until caught up; 3. what tables and topic hold;
# 4. Airflow (scripts/airflow.sh): the sessionizer DAG keeps streaming while more live events
#    arrive; a late batch (orders, then pageviews) is backfilled by triggering the
#    late_batch_backfill DAG through the REST API -- the same as its form in the UI;
# 5. the corrections on the sessions topic; the UI URL, its login, and the quality reports.
#
# Everything binds to 127.0.0.1 and writes under var/ (the demo's tables, checkpoints and
# landing folder under var/demo, reset at each start: the embedded broker keeps its data in
# memory only, so tables from an earlier demo would not match it; an exported
# CLICKSTREAM_WAREHOUSE / _HOME / _LANDING or KAFKA_BOOTSTRAP_SERVERS is not used, so the demo
# never writes into your own tables). It stops at once if the broker's port
# (CLICKSTREAM_BROKER_PORT, 9092) or, unless --no-airflow, Airflow's (AIRFLOW_PORT, 8080) is
# taken. Ctrl-C stops everything.
set -euo pipefail
cd "$(dirname "$0")/.."
WITH_AIRFLOW=1
case "$#:${1:-}" in
  0:) ;;
  1:--no-airflow) WITH_AIRFLOW=0 ;;
  # The header comment above, without its '#'.
  *:-h|*:--help) sed -n '1d; /^#/!q; s/^# \{0,1\}//p' "$0"; exit 0 ;;
  *) echo "demo.sh: unknown argument(s) '$*'; use --no-airflow, or --help" >&2; exit 2 ;;
esac
bash scripts/setup.sh

PORT="${CLICKSTREAM_BROKER_PORT:-9092}"
# shellcheck source=scripts/airflow.sh
source scripts/airflow.sh
# Before anything is reset: a demo still running would lose its tables under it.
if _port_open "$PORT"; then  # an earlier broker would hold data the new tables do not match
  echo "demo.sh: port $PORT is in use (an earlier demo or broker still running?); stop it, or" \
       "set CLICKSTREAM_BROKER_PORT to a free port" >&2
  exit 1
fi
# And Airflow's (airflow_start checks it too, but only after minutes of the demo's first part).
if [ "$WITH_AIRFLOW" = 1 ] && _port_open "${AIRFLOW_PORT:-8080}"; then
  echo "demo.sh: port ${AIRFLOW_PORT:-8080} is in use (an Airflow still running?); stop it, set" \
       "AIRFLOW_PORT to a free port, or run with --no-airflow" >&2
  exit 1
fi

DEMO=var/demo
rm -rf "$DEMO"
mkdir -p "$DEMO"
export CLICKSTREAM_WAREHOUSE="$PWD/$DEMO/warehouse"
export CLICKSTREAM_HOME="$PWD/$DEMO/home"
export CLICKSTREAM_LANDING="$PWD/$DEMO/landing"
export KAFKA_BOOTSTRAP_SERVERS="127.0.0.1:$PORT"
CLI=.venv/bin/clickstream
LOG=$DEMO/broker.log

BACKGROUND=()
cleanup() {
  echo
  echo "== stopping everything the demo started"
  airflow_stop
  for pid in "${BACKGROUND[@]}"; do kill "$pid" 2>/dev/null || true; done
  for pid in "${BACKGROUND[@]}"; do wait "$pid" 2>/dev/null || true; done
}
trap cleanup EXIT
trap 'exit 130' INT TERM

echo "== starting the embedded broker on 127.0.0.1:$PORT (log: $LOG)"
# In a session of its own: Ctrl-C in the terminal reaches the foreground command (a
# sessionizer then finishes its micro-batch against a live broker), and cleanup stops the
# broker after it.
setsid "$CLI" broker --port "$PORT" >"$LOG" 2>&1 < /dev/null &
BROKER=$!
BACKGROUND+=("$BROKER")
for _ in $(seq 1 100); do
  grep -q "^embedded broker ready on" "$LOG" 2>/dev/null && break
  kill -0 "$BROKER" 2>/dev/null || { cat "$LOG" >&2; exit 1; }
  sleep 0.1
done
cat "$LOG"

echo "== producing one day of demo events for 3 clients"
"$CLI" generate events --clients 3 --users 200 --minutes 1440 --rate 50000

echo "== sessionizing everything available, then stopping"
"$CLI" sessionize --until-caught-up --max-events-per-trigger 1500

echo "== what the tables and the sessions topic hold"
"$CLI" inspect --topic sessions --sample 2

[ "$WITH_AIRFLOW" = 1 ] || exit 0

echo "== a late batch for client-00 lands: the same day from another source (in the landing folder)"
"$CLI" generate history --client client-00 --days 1 --users 200 --seed 23 \
  --start 2026-11-01T00:00:00+00:00 --out late-2026-11-01

airflow_start
airflow_banner
echo "   Open the UI now to watch the sessionizer stream and the backfills below run."
echo "== more live events stream in (the sessionizer DAG picks them up; log: $DEMO/live.log)"
"$CLI" generate events --clients 3 --users 200 --minutes 1440 --seed 8 \
  --start 2026-11-02T00:00:00+00:00 --rate 300 >"$DEMO/live.log" 2>&1 &
BACKGROUND+=("$!")

for kind in orders pageviews; do
  echo "== backfill: trigger late_batch_backfill for the late $kind (REST API = the UI's form)"
  status=0
  .venv/bin/python scripts/airflow_demo.py trigger late_batch_backfill --conf \
    "{\"client\": \"client-00\", \"kind\": \"$kind\", \"path\": \"late-2026-11-01/$kind\", \"dry_run\": false}" \
    || status=$?
  case $status in
    0) ;;
    4) echo "   (the run is still running after the script's timeout: follow it in the UI)" ;;
    *) echo "   (the run failed: see its task logs in the UI)" ;;
  esac
done

echo "== corrections on Kafka: the sessions topic read as a compacted changelog"
.venv/bin/python - <<'PY'
from clickstream.config import Config
from clickstream.io.kafka_clients import read_compacted

config = Config.from_env()
view = read_compacted(config, config.sessions_topic)
fixed = [v for v in view.values() if v.get("revision", 1) > 1]
print(f"{len(view)} live sessions on topic {config.sessions_topic}; {len(fixed)} of them "
      "corrected by the backfills (revision > 1); retracted ones are tombstoned. E.g.:")
for value in fixed[:3]:
    print("  ", {k: value.get(k) for k in ("session_id", "user_id", "session_start",
                                          "pageview_count", "order_count", "revenue",
                                          "revision")})
PY
"$CLI" inspect

if [ -n "${AIRFLOW_NEW_PASSWORD:-}" ]; then  # as airflow_banner decides
  LOGIN="user admin; the password was printed above, once"
else
  LOGIN="user admin; the password is in $AIRFLOW_PASSWORD_FILE"
fi
cat <<EOF

 Airflow UI: $AIRFLOW_URL  ($LOGIN)
 In the UI:  DAGs -> sessionizer (continuous), late_batch_backfill (two runs: open one, see
             each task's log), scheduled_recompute, table_maintenance; Assets -> the tables
             the backfill changed; late_batch_backfill -> Trigger -> the form (try a dry run,
             or path ../elsewhere to see it refused).
 Reports:    'Quality reports' in the navigation: gates, Data Docs, correction reports
             (on disk: $CLICKSTREAM_HOME/reports/index.html).
 Data:       $CLICKSTREAM_WAREHOUSE  (landing folder: $CLICKSTREAM_LANDING)
Running until Ctrl-C.
EOF
while true; do sleep 2; done
