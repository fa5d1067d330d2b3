"""flowers_job: PySpark-native distributed training for image classification.

Photos -> Delta tables (Spark) -> Petastorm shards -> TorchDistributor DDP training ->
MLflow tracking and model registry. See README.md for the architecture.
"""

__version__ = "0.1.0"
