"""Data-quality gates with Great Expectations, and the quality reports.

WHERE DATA QUALITY IS CHECKED. One gate per step of the data flow, each a versioned GX suite in
``expectations/<gate>.json``:

* ``checks``  — Spark: a step's data -> one row of check results (+ the rows behind each check);
* ``suites``  — the suites and the Great Expectations engine that validates check results;
* ``gates``   — ``run_gate`` and the ``gate_*`` functions the jobs call (quarantine, stop);
* ``reports`` — Data Docs pages and the index under ``$CLICKSTREAM_HOME/reports``;
* ``correction_report`` — what a backfill / recompute run changed, as an HTML page.

Submodules are imported explicitly: Great Expectations itself is imported only when a gate
first runs (it takes seconds).
"""
