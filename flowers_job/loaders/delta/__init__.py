"""The Delta loader (``data.loader=delta``): the ranks read the ``images`` table's own
Parquet files at the version the driver planned, with delta-rs, and write no cache."""
