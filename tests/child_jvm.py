"""How the tests start the JVMs of child processes: the spark-submit steps of DAG runs, the
CLI runs of the crash tests.

Each lives for seconds to minutes on a few rows, so C2's optimising compiler, running on the
second core while the other test worker needs it, costs more CPU than its code saves. C1 only
(``-XX:TieredStopAtLevel=1``) took the backfill kill -9 test from 278 to 197 CPU-seconds
(165 to 138 s) in session 32. The JIT tier changes nothing a test asserts; the product keeps the
JVM's defaults, and so does each test worker's own long-lived SparkSession, where C2 pays off.
"""

from __future__ import annotations

JAVA_TOOL_OPTIONS = "-XX:TieredStopAtLevel=1"
"""Set in a child's environment (the JVM reads it before its command line; it notes so on
stderr: ``Picked up JAVA_TOOL_OPTIONS: ...``)."""
