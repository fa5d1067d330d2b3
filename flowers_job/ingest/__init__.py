"""Photos to Delta tables on the driver, with decode on the executors in Spark tasks: full and incremental ingest, the quarantine, idempotence."""
