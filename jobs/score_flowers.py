"""spark-submit entry point: the same as ``flowers-job predict``.

    spark-submit --packages io.delta:delta-spark_4.2_2.13:4.4.0 jobs/score_flowers.py \
        --output-dir /data/flowers_out --images /data/new_photos --output-table /data/scored

Arguments after the script are those of ``flowers-job predict`` (``--help`` lists them);
without ``--model`` it scores with the version the last run in ``--output-dir`` registered.
The SparkSession is the one spark-submit configured (master, resources, Delta jars).
"""

import sys

from flowers_job.cli import main

if __name__ == "__main__":
    sys.exit(main(["predict", *sys.argv[1:]]))
