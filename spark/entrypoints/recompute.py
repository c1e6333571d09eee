"""spark-submit entry point: ``spark-submit spark/entrypoints/recompute.py [--client C]``.

Wiring only: the arguments are ``clickstream recompute``'s, the work is
``clickstream.jobs.recompute`` (the ``scheduled_recompute`` DAG's task).
The master spark-submit was given is the job's Spark master, unless ``--spark-master`` is passed.
"""

import sys

from clickstream.cli import main
from clickstream.spark_session import submitted_args

if __name__ == "__main__":
    sys.exit(main(submitted_args("recompute", sys.argv[1:])))
