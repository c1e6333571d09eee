"""spark-submit entry point: ``spark-submit spark/entrypoints/backfill_step.py STEP --kind K
--client C --path P [--run-id R] [--dry-run true|false]``.

Wiring only: the arguments are ``clickstream backfill-step``'s, the work is
``clickstream.jobs.backfill_steps.run_step`` (the ``late_batch_backfill`` DAG's Spark tasks).
The master spark-submit was given is the job's Spark master, unless ``--spark-master`` is passed.
"""

import sys

from clickstream.cli import main
from clickstream.spark_session import submitted_args

if __name__ == "__main__":
    sys.exit(main(submitted_args("backfill-step", sys.argv[1:])))
