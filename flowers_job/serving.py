"""The registered model: an MLflow pyfunc that takes JPEG/PNG bytes, returns probabilities.

Input: a pandas DataFrame with a column ``image`` holding each image's file bytes
(any format Pillow reads). Output: a DataFrame with one row per input image and one
float64 column per label (``label_names`` order) holding class probabilities that sum to 1.

Images are decoded exactly as at ingest (EXIF orientation, ICC -> sRGB, 8-bit RGB) and
then resized and centre-cropped as at validation.

One decode/transform/model path serves everyone: :meth:`FlowersClassifierModel.score`
scores a list of image bytes and returns the probabilities with a rejection per row that
does not decode (ingest's reason codes). ``predict`` (in-process pyfunc and the REST server
of ``mlflow models serve``) calls it and refuses a batch with a bad image by raising
``MlflowException`` with ``INVALID_PARAMETER_VALUE``, which the scoring server answers with
HTTP 400 and the message naming the row; ``flowers-job predict`` (:mod:`flowers_job.predict`)
calls it on the executors and writes a row with the reason instead.
"""

from __future__ import annotations

import base64
import binascii
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import pandas as pd
import torch
from mlflow.exceptions import MlflowException
from mlflow.protos.databricks_pb2 import INVALID_PARAMETER_VALUE
from mlflow.pyfunc import PythonModel

from flowers_job.config import JobConfig
from flowers_job.data.images import ImageRejected

__all__ = ["MAX_ROWS_NAMED", "SCORE_BATCH_SIZE", "FlowersClassifierModel", "Scores", "model_config"]

MAX_ROWS_NAMED = 5
"""A refused request names at most this many bad rows (and counts the rest)."""


@dataclass(frozen=True)
class Scores:
    """What :meth:`FlowersClassifierModel.score` returns for N images.

    Attributes:
        probabilities: float64 ``[N, num_labels]``, columns in ``label_names`` order; each
            scored row sums to 1; a rejected row is all NaN.
        rejections: N entries: None for a scored row, else the
            :class:`~flowers_job.data.images.ImageRejected` that says why (``code`` is one of
            ingest's reason codes: ``empty_file``, ``not_an_image``, ``too_many_pixels``,
            ``corrupt``, or ``decode_error`` for any other failure to decode).
    """

    probabilities: np.ndarray
    rejections: list[ImageRejected | None]


SCORE_BATCH_SIZE = 32
"""Images per forward pass of :meth:`FlowersClassifierModel.score` (``model_config``'s
``batch_size``): the training ranks' per-device batch on CPU. Batch scoring of the 3,670
stored photos in 8 Spark tasks on 2 cores ran at 96-101 images/s with 32 against 70-79 with
64 (interleaved, one session, 2026-11-25; 90 with 16): at 224 px a batch of 64 makes every
activation map about 100 MB, and the element-wise layers (batch norm, ReLU6, padding) of
two concurrent workers then wait on memory. A model registered before keeps its own
``batch_size``."""


def model_config(cfg: JobConfig, label_names: list[str]) -> dict[str, Any]:
    """The pyfunc's ``model_config`` for a model trained with ``cfg``: what
    :meth:`FlowersClassifierModel.load_context` rebuilds the network and its preprocessing
    from (the architecture, labels, the stored size and crop of the training images, the
    backbone's normalisation, the decompression-bomb guard)."""
    from flowers_job.models import preprocessing_for

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
    """MLflow pyfunc wrapper around :class:`flowers_job.models.Classifier`.

    ``model_config`` keys: architecture, label_names, image_size, resize_size, mean, std,
    dropout, max_pixels, batch_size. Artifact ``state_dict``: the classifier's weights.
    """

    def load_context(self, context: Any) -> None:
        """Build the network from ``model_config`` and its weights; tune this process's
        allocator (:func:`flowers_job.allocator.tune_this_process`) first: a REST server or a
        notebook starts without the job's variables, and glibc's defaults made a batch of 32
        at 224 px 4x slower (1.2-1.35 s against 0.31-0.32 s, 2 threads, measured in-process)."""
        from flowers_job.allocator import tune_this_process
        from flowers_job.data.images import eval_pixels
        from flowers_job.models import build_model
        from flowers_job.train.step import DeviceNormalize

        tune_this_process()
        cfg = context.model_config
        self.label_names = list(cfg["label_names"])
        self.max_pixels = int(cfg["max_pixels"])
        self.batch_size = int(cfg.get("batch_size", SCORE_BATCH_SIZE))
        self.model = build_model(
            cfg["architecture"],
            len(self.label_names),
            "none",
            freeze_backbone=False,
            dropout=float(cfg["dropout"]),
        )
        state = torch.load(context.artifacts["state_dict"], map_location="cpu", weights_only=True)
        self.model.load_state_dict(state)
        # Channels-last, as training runs it: on 320 real photos, 224 px, batches of 64, the
        # model scored 108 img/s against 50 img/s contiguous at 1 thread, and 154 against 108
        # at 2 threads (this 2-core machine, 2026-11-24).
        self.model.to(memory_format=torch.channels_last)  # type: ignore[call-overload]
        self.model.eval()
        # The evaluation path's: uint8 pixels per image, normalised once per batch
        # (DeviceNormalize), not a float32 copy per image.
        self.pixels = eval_pixels(int(cfg["image_size"]), int(cfg["resize_size"]))
        self.normalize = DeviceNormalize(tuple(cfg["mean"]), tuple(cfg["std"]), torch.device("cpu"))

    def score(self, contents: Sequence[bytes | bytearray | memoryview | None]) -> Scores:
        """Decode and score N images; a row that does not decode is rejected, not raised.

        Args:
            contents: N file bytes (any format Pillow reads); None (or NaN) counts as an
                empty file, any other non-bytes value is ``not_an_image``.

        Returns:
            :class:`Scores`: float64 ``[N, num_labels]`` probabilities (NaN rows where
            rejected) and N rejections (None where scored). The decodable rows go through the
            model in batches of ``batch_size``.
        """
        from flowers_job.data.images import open_rgb

        n = len(contents)
        probabilities = np.full((n, len(self.label_names)), np.nan)
        rejections: list[ImageRejected | None] = [None] * n
        tensors: list[torch.Tensor] = []
        rows: list[int] = []

        def flush() -> None:
            with torch.inference_mode():
                logits = self.model(self.normalize(torch.stack(tensors)))
            probabilities[rows] = torch.softmax(logits.float(), dim=1).double().numpy()
            tensors.clear()
            rows.clear()

        for i, content in enumerate(contents):
            raw = b""
            try:
                raw = _as_bytes(content)
                img, _, _ = open_rgb(raw, max_pixels=self.max_pixels)
                tensors.append(self.pixels(img))
            except ImageRejected as exc:
                rejections[i] = _explain(exc, raw)
                continue
            except Exception as exc:  # any other decoder failure: a row, not a crash
                rejections[i] = ImageRejected("decode_error", f"{type(exc).__name__}: {exc}")
                continue
            rows.append(i)
            if len(tensors) == self.batch_size:
                flush()
        if tensors:
            flush()
        return Scores(probabilities, rejections)

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


def _as_bytes(content: object) -> bytes:
    """One input cell as bytes: None/NaN -> ``b""`` (then ``empty_file``).

    Raises:
        ImageRejected: ``not_an_image`` for a value that is not bytes (a string, a number).
    """
    if isinstance(content, bytes | bytearray | memoryview):
        return bytes(content)
    if content is None or (isinstance(content, float) and np.isnan(content)):
        return b""
    raise ImageRejected(
        "not_an_image", f"expected the image file's bytes, got a {type(content).__name__}"
    )


def _explain(exc: ImageRejected, raw: bytes) -> ImageRejected:
    """``exc``, with a hint when the bytes are base64 text rather than an image (a client that
    sent the ``inputs`` JSON format, which MLflow does not base64-decode for binary columns)."""
    if exc.code != "not_an_image" or not raw:
        return exc
    try:
        base64.b64decode(raw, validate=True)
    except (binascii.Error, ValueError):
        return exc
    return ImageRejected(
        exc.code,
        f"{exc.message}; the bytes are base64 text: send images in a dataframe_split or "
        "dataframe_records payload, where MLflow base64-decodes the binary 'image' column",
    )
