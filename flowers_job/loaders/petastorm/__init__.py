"""The Petastorm loader: its driver side (the balanced Parquet cache) and its rank side (readers by row group), and pyarrow's S3 file system in the form Petastorm reads."""
