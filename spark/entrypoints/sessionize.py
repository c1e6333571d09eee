"""spark-submit entry point: ``spark-submit spark/entrypoints/sessionize.py [--until-caught-up]``.

Wiring only: the arguments are the CLI's, the work is ``clickstream.jobs.sessionize``.
Under spark-submit, the ``--master`` it was given (for the Airflow ``sessionizer`` DAG: the
``spark_default`` connection) is the job's Spark master, unless ``--spark-master`` is passed.
"""

import os
import sys

from clickstream.cli import main


def submitted_master() -> str | None:
    """The master spark-submit launched this driver with; None outside spark-submit."""
    if "PYSPARK_GATEWAY_PORT" not in os.environ:
        return None
    from pyspark import SparkConf
    from pyspark.context import SparkContext

    SparkContext._ensure_initialized()  # connects to spark-submit's JVM; starts no new one
    return SparkConf().get("spark.master", None)


if __name__ == "__main__":
    args = sys.argv[1:]
    master = None if any(a.startswith("--spark-master") for a in args) else submitted_master()
    sys.exit(main(["sessionize", *args, *(["--spark-master", master] if master else [])]))
