#!/usr/bin/env bash
# Create .venv with the exact locked dependencies and the clickstream package (idempotent).
set -euo pipefail
cd "$(dirname "$0")/.."

PYTHON="${PYTHON:-python3.11}"
command -v "$PYTHON" >/dev/null 2>&1 || PYTHON=python3
"$PYTHON" -c 'import sys; assert sys.version_info[:2] == (3, 11), sys.version' 2>/dev/null || {
  echo "setup: Python 3.11 is required (found: $("$PYTHON" --version 2>&1))" >&2; exit 1; }

if ! command -v java >/dev/null 2>&1; then
  if [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null 2>&1; then
    echo "setup: installing a Java runtime for Spark (openjdk-17-jre-headless)"
    apt-get update -qq && apt-get install -y -qq openjdk-17-jre-headless >/dev/null
  else
    echo "setup: Spark needs Java 17 on PATH; install openjdk-17-jre-headless" >&2; exit 1
  fi
fi
# The version line, not the first: JAVA_TOOL_OPTIONS and the like print "Picked up ..." above it.
java_version=$(java -version 2>&1 | grep -m1 ' version "' || true)
java_major=$(printf '%s' "$java_version" | sed -nE 's/.* version "([0-9]+).*/\1/p')
if [ -z "$java_major" ] || [ "$java_major" -lt 17 ]; then
  echo "setup: Spark 4 needs Java 17 or newer; 'java' on PATH says: ${java_version:-$(java -version 2>&1 | tail -1)}" >&2
  exit 1
fi

# The stamp is the lock plus how it was installed: a venv set up differently is synced again.
stamp=.venv/.clickstream-lock
installed() { cat requirements.lock; echo "# installed with: uv pip sync --compile-bytecode"; }
if [ ! -x .venv/bin/python ]; then
  "$PYTHON" -m venv .venv
fi
if [ ! -f "$stamp" ] || ! installed | cmp -s - "$stamp"; then
  echo "setup: installing locked dependencies into .venv"
  if [ ! -x .venv/bin/uv ]; then
    .venv/bin/python -m pip --version >/dev/null 2>&1 || .venv/bin/python -m ensurepip --upgrade >/dev/null
    .venv/bin/python -m pip install --quiet --disable-pip-version-check "$(grep '^uv==' requirements.lock)"
  fi
  # Bytecode is compiled here, once: uv does not by default, and where PYTHONDONTWRITEBYTECODE
  # is set (these machines) every process would otherwise compile what it imports from
  # source -- 9-10 s for Great Expectations alone, in every Spark job, gate and test process.
  .venv/bin/uv pip sync --quiet --compile-bytecode --python .venv/bin/python requirements.lock
  installed > "$stamp"
fi
# Built with the locked setuptools in .venv, not one fetched for an isolated build: the same
# build on every machine, and none needs the package index once the lock is installed.
.venv/bin/uv pip install --quiet --python .venv/bin/python --no-deps --no-build-isolation -e .
# Every Spark job starts a JVM that loads ~12,000 classes from Spark's jars; an archive of them
# (Java's class-data sharing), made once for this JVM and these jars, halves a short job's
# start-up CPU (spark/clickstream/jvm_class_archive.py). Jobs run the same without it.
.venv/bin/python -m clickstream.jvm_class_archive --if-stale \
  || echo "setup: warning: no JVM class archive (above); Spark jobs will start slower" >&2
echo "setup: ready (.venv/bin/clickstream)"
