"""MLflow from rank 0 and the driver: the run, its metrics, the logged model, the registry, credentials, the test report."""
