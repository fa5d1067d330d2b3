"""The MLflow run tags the job sets and reads back: constants only, so that what reads a tag
(retention, ``flowers-job runs``, promotion) imports neither MLflow nor torch."""

__all__ = [
    "TAG_FINGERPRINT",
    "TAG_IMAGES_TABLE",
    "TAG_IMAGES_VERSION",
    "TAG_OUTPUT_DIR",
    "TAG_TEST_SPLIT",
    "TAG_VERSION",
]

TAG_FINGERPRINT = "flowers_job.ingest_fingerprint"
TAG_TEST_SPLIT = "flowers_job.test_split_digest"
"""Run tag: the digest of the test split a run was scored on
(:func:`flowers_job.driver.prepare.split_digest`); test scores compare only between equal
digests."""
TAG_VERSION = "flowers_job.version"
TAG_IMAGES_TABLE = "flowers_job.images_table"
TAG_IMAGES_VERSION = "flowers_job.images_version"
"""MLflow run tags: the ``images`` table and the Delta version a run trained on
(retention keeps that version readable: :mod:`flowers_job.ingest.retention`)."""
TAG_OUTPUT_DIR = "flowers_job.output_dir"
"""Run tag: the resolved ``paths.output_dir`` of the training, set when the run starts
(``flowers-job runs`` lists an output dir's runs by it: :mod:`flowers_job.driver.runs`)."""
