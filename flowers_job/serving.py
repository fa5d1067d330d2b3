"""The registered model: an MLflow pyfunc that takes JPEG/PNG bytes, returns probabilities.

Input: a pandas DataFrame with a column ``image`` holding each image's file bytes
(any format Pillow reads). Output: a DataFrame with one row per input image and one
float64 column per label (``label_names`` order) holding class probabilities that sum to 1.

Images are decoded exactly as at ingest (EXIF orientation, ICC -> sRGB, 8-bit RGB) and
then resized and centre-cropped as at validation.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import pandas as pd
import torch
from mlflow.pyfunc import PythonModel

__all__ = ["FlowersClassifierModel"]


class FlowersClassifierModel(PythonModel):
    """MLflow pyfunc wrapper around :class:`flowers_job.models.Classifier`.

    ``model_config`` keys: architecture, label_names, image_size, resize_size, mean, std,
    dropout, max_pixels, batch_size. Artifact ``state_dict``: the classifier's weights.
    """

    def load_context(self, context: Any) -> None:
        from flowers_job.data.images import eval_transform
        from flowers_job.models import build_model

        cfg = context.model_config
        self.label_names = list(cfg["label_names"])
        self.max_pixels = int(cfg["max_pixels"])
        self.batch_size = int(cfg.get("batch_size", 64))
        self.model = build_model(
            cfg["architecture"],
            len(self.label_names),
            "none",
            freeze_backbone=False,
            dropout=float(cfg["dropout"]),
        )
        state = torch.load(context.artifacts["state_dict"], map_location="cpu", weights_only=True)
        self.model.load_state_dict(state)
        self.model.eval()
        self.transform = eval_transform(
            int(cfg["image_size"]), int(cfg["resize_size"]), tuple(cfg["mean"]), tuple(cfg["std"])
        )

    def predict(self, context, model_input, params=None):  # type: ignore[no-untyped-def]
        """Class probabilities, ``[N rows x num_labels columns]`` float64.

        Raises:
            KeyError: the input has no ``image`` column.
            flowers_job.data.images.ImageRejected: an image that does not decode (names the row).
        """
        from flowers_job.data.images import ImageRejected, open_rgb

        frame = model_input if isinstance(model_input, pd.DataFrame) else pd.DataFrame(model_input)
        contents = list(frame["image"])
        probs: list[np.ndarray] = []
        for start in range(0, len(contents), self.batch_size):
            tensors = []
            for i, content in enumerate(contents[start : start + self.batch_size], start):
                raw = content if isinstance(content, bytes | bytearray) else bytes(content)
                try:
                    img, _, _ = open_rgb(bytes(raw), max_pixels=self.max_pixels)
                except ImageRejected as exc:
                    raise ImageRejected(exc.code, f"row {i}: {exc.message}") from None
                tensors.append(self.transform(img))
            with torch.inference_mode():
                logits = self.model(torch.stack(tensors))
            probs.append(torch.softmax(logits.float(), dim=1).double().numpy())
        data = np.concatenate(probs) if probs else np.zeros((0, len(self.label_names)))
        return pd.DataFrame(data, columns=self.label_names)
