"""spark-submit entry point: the same as ``flowers-job run``.

    spark-submit --packages io.delta:delta-spark_4.2_2.13:4.4.0 jobs/train_flowers.py \
        --images /data/flower_photos --output-dir /data/flowers_out [--set KEY=VALUE ...]

Arguments after the script are those of ``flowers-job run`` (``--help`` lists them).
The SparkSession is the one spark-submit configured (master, resources, Delta jars). On a
Spark Connect server (docs/cluster.md), the Delta jar belongs to the server:

    spark-submit --remote sc://HOST:15002 jobs/train_flowers.py --images ... \
        --output-dir ... --set data.loader=streaming
"""

import sys

from flowers_job.cli import main

if __name__ == "__main__":
    sys.exit(main(["run", *sys.argv[1:]]))
