"""A folder of photos, local or in an object store, listed and read in Spark tasks on the executors; shared by ingest and batch predict."""
