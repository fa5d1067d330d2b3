"""The job's Delta tables: where each lives (path or catalog name), schemas, the commits and their checks, retention. Runs on the driver."""
