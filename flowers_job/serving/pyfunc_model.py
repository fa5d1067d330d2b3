"""The registered model: an MLflow pyfunc that takes JPEG/PNG bytes, returns probabilities.

Input: a pandas DataFrame with a column ``image`` holding each image's file bytes
(any format Pillow reads). Output: a DataFrame with one row per input image and one
float64 column per label (``label_names`` order) holding class probabilities that sum to 1.

Images are decoded exactly as at ingest (EXIF orientation, ICC -> sRGB, 8-bit RGB) and
then resized and centre-cropped as at validation.

The decoding and the network live in :class:`flowers_job.serving.scorer.Scorer` (on a GPU when
there is one); this module is its MLflow face.

One decode/transform/model path serves everyone: :meth:`FlowersClassifierModel.score`
scores a list of image bytes and returns the probabilities with a rejection per row that
does not decode (ingest's reason codes). ``predict`` (in-process pyfunc and the REST server
of ``mlflow models serve``) calls it and refuses a batch with a bad image by raising
``MlflowException`` with ``INVALID_PARAMETER_VALUE``, which the scoring server answers with
HTTP 400 and the message naming the row; ``flowers-job predict`` (:mod:`flowers_job.serving.batch_predict`)
calls it on the executors and writes a row with the reason instead.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import pandas as pd
from mlflow.exceptions import MlflowException
from mlflow.protos.databricks_pb2 import INVALID_PARAMETER_VALUE
from mlflow.pyfunc import PythonModel

from flowers_job.config import JobConfig
from flowers_job.serving.scorer import SCORE_BATCH_SIZE, Scorer, Scores

__all__ = ["MAX_ROWS_NAMED", "SCORE_BATCH_SIZE", "FlowersClassifierModel", "Scores", "model_config"]

MAX_ROWS_NAMED = 5
"""A refused request names at most this many bad rows (and counts the rest)."""


def model_config(cfg: JobConfig, label_names: list[str]) -> dict[str, Any]:
    """The pyfunc's ``model_config`` for a model trained with ``cfg``: what
    :meth:`FlowersClassifierModel.load_context` rebuilds the network and its preprocessing
    from (the architecture, labels, the stored size and crop of the training images, the
    backbone's normalisation, the decompression-bomb guard)."""
    from flowers_job.vision.backbones import preprocessing_for

    pre = preprocessing_for(cfg.model.architecture)
    return {
        "architecture": cfg.model.architecture,
        "label_names": list(label_names),
        "image_size": cfg.data.image_size,
        "resize_size": cfg.data.stored_short_side,
        "mean": list(pre.mean),
        "std": list(pre.std),
        "dropout": cfg.model.dropout,
        "max_pixels": cfg.data.max_image_pixels,
        "batch_size": SCORE_BATCH_SIZE,
    }


class FlowersClassifierModel(PythonModel):
    """MLflow pyfunc wrapper around :class:`flowers_job.serving.scorer.Scorer`.

    ``model_config`` keys: architecture, label_names, image_size, resize_size, mean, std,
    dropout, max_pixels, batch_size. Artifact ``state_dict``: the classifier's weights.
    """

    def load_context(self, context: Any) -> None:
        """Build the :class:`~flowers_job.serving.scorer.Scorer`; tune this process's allocator
        (:func:`flowers_job.runtime.allocator.tune_this_process`) first: a REST server or a
        notebook starts without the job's variables, and glibc's defaults made a batch of 32
        at 224 px 4x slower (1.2-1.35 s against 0.31-0.32 s, 2 threads, measured in-process)."""
        from flowers_job.runtime.allocator import tune_this_process

        tune_this_process()
        self.scorer = Scorer(context.model_config, context.artifacts["state_dict"])
        self.label_names = self.scorer.label_names
        self.model = self.scorer.model

    def score(self, contents: Sequence[bytes | bytearray | memoryview | None]) -> Scores:
        """:meth:`Scorer.score <flowers_job.serving.scorer.Scorer.score>`."""
        return self.scorer.score(contents)

    def predict(self, context, model_input, params=None):  # type: ignore[no-untyped-def]
        """Class probabilities, ``[N rows x num_labels columns]`` float64.

        Raises:
            KeyError: the input has no ``image`` column.
            mlflow.exceptions.MlflowException: ``INVALID_PARAMETER_VALUE`` (HTTP 400 from the
                scoring server) when an image does not decode; the message names each bad row
                (up to :data:`MAX_ROWS_NAMED`) with its reason code, e.g. ``row 3: corrupt:
                ...``. No row of the request is scored then.
        """
        frame = model_input if isinstance(model_input, pd.DataFrame) else pd.DataFrame(model_input)
        scores = self.score(list(frame["image"]))
        bad = [(i, r) for i, r in enumerate(scores.rejections) if r is not None]
        if bad:
            named = "; ".join(f"row {i}: {r.code}: {r.message}" for i, r in bad[:MAX_ROWS_NAMED])
            more = f" (and {len(bad) - MAX_ROWS_NAMED} more)" if len(bad) > MAX_ROWS_NAMED else ""
            raise MlflowException(
                f"{len(bad)} of {len(scores.rejections)} images cannot be decoded, nothing was "
                f"scored: {named}{more}",
                error_code=INVALID_PARAMETER_VALUE,
            )
        return pd.DataFrame(scores.probabilities, columns=self.label_names)
