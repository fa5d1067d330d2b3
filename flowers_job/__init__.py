"""flowers_job: PySpark-native distributed training for image classification.

Photos -> Delta tables (Spark) -> Petastorm or Mosaic Streaming shards -> TorchDistributor
DDP training -> MLflow tracking and model registry. docs/architecture.md has the design.
"""

__version__ = "0.2.0"
