"""The job top to bottom on the driver: the pipeline, data preparation, the ranks' reports read back, automatic restarts, runs and the champion alias."""
