"""spark-submit entry point: ``spark-submit spark/entrypoints/sessionize.py [--until-caught-up]``.

Wiring only: the arguments are the CLI's, the work is ``clickstream.jobs.sessionize``.
"""

import sys

from clickstream.cli import main

if __name__ == "__main__":
    sys.exit(main(["sessionize", *sys.argv[1:]]))
