"""spark-submit entry point: ``spark-submit spark/entrypoints/sessionize.py [--until-caught-up]``.

Wiring only: the arguments are the CLI's, the work is ``clickstream.jobs.sessionize``.
Under spark-submit, the ``--master`` it was given (for the Airflow ``sessionizer`` DAG: the
``spark_default`` connection) is the job's Spark master, unless ``--spark-master`` is passed.
"""

import sys

from clickstream.cli import main
from clickstream.spark_session import submitted_args

if __name__ == "__main__":
    sys.exit(main(submitted_args("sessionize", sys.argv[1:])))
