#!/usr/bin/env bash
# Set up, then run the main job on the embedded default profile:
# embedded broker -> demo events (out of order, duplicates, late and bad records) -> sessionizer
# until caught up -> what the tables and the sessions topic hold. Everything stays on 127.0.0.1
# and under var/ (override with CLICKSTREAM_HOME / CLICKSTREAM_WAREHOUSE).
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh

PORT="${CLICKSTREAM_BROKER_PORT:-9092}"
export KAFKA_BOOTSTRAP_SERVERS="${KAFKA_BOOTSTRAP_SERVERS:-127.0.0.1:$PORT}"
CLI=.venv/bin/clickstream
mkdir -p var
LOG=var/broker.log

echo "== starting the embedded broker on 127.0.0.1:$PORT (log: $LOG)"
"$CLI" broker --port "$PORT" >"$LOG" 2>&1 &
BROKER=$!
trap 'kill "$BROKER" 2>/dev/null; wait "$BROKER" 2>/dev/null || true' EXIT
for _ in $(seq 1 100); do
  grep -q "ready" "$LOG" 2>/dev/null && break
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
