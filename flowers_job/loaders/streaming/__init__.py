"""The Mosaic Streaming loader: its driver side (MDS shards, local or in an object store) and its rank side (StreamingDataset readers)."""
