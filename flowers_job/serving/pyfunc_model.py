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

**Limits per request** (``serving.max_rows``, ``serving.max_request_bytes``, baked into
``model_config`` at registration): ``predict`` refuses a request with more rows or more image
bytes, with ``INVALID_PARAMETER_VALUE`` (HTTP 400), before any image is decoded. Under
``mlflow models serve``, :func:`guard_scoring_server` also answers a body over
``max_request_bytes`` with 413 before MLflow parses it, and a request without a Content-Type
with 415 (MLflow's own server raises ``AttributeError`` on it: a 500).
"""

from __future__ import annotations

import functools
import inspect
import logging
import sys
from collections.abc import Callable, Sequence
from typing import Any

import pandas as pd
from mlflow.exceptions import MlflowException
from mlflow.protos.databricks_pb2 import INVALID_PARAMETER_VALUE
from mlflow.pyfunc import PythonModel

from flowers_job.config import JobConfig
from flowers_job.config.model import ServingConfig
from flowers_job.serving.scorer import SCORE_BATCH_SIZE, Scorer, Scores
from flowers_job.vision.pillow_floor import check_pillow

__all__ = [
    "MAX_ROWS_NAMED",
    "SCORE_BATCH_SIZE",
    "FlowersClassifierModel",
    "Scores",
    "guard_scoring_server",
    "model_config",
]

log = logging.getLogger(__name__)

SCORING_APP = "mlflow.pyfunc.scoring_server.app"
"""The module of ``mlflow models serve``'s app (MLflow 3.0 to 3.17 at least): it loads the
model while it is imported (``app = init(load_model(...))``), so the model's ``load_context``
runs with it in ``sys.modules`` in exactly that server."""
INVOCATIONS_PARAMETERS = ("data", "content_type", "model", "input_schema")
"""The parameters of ``mlflow.pyfunc.scoring_server.invocations`` that the guard wraps (the
same in MLflow 3.0.1, 3.8.1 and 3.17.2); another signature is left alone, logged."""

MAX_ROWS_NAMED = 5
"""A refused request names at most this many bad rows (and counts the rest)."""


def model_config(cfg: JobConfig, label_names: list[str]) -> dict[str, Any]:
    """The pyfunc's ``model_config`` for a model trained with ``cfg``: what
    :meth:`FlowersClassifierModel.load_context` rebuilds the network and its preprocessing
    from (the architecture, labels, the stored size and crop of the training images, the
    backbone's normalisation, the decompression-bomb guard)."""
    from flowers_job.vision.backbones import preprocessing_for
    from flowers_job.vision.limits import ImageLimits

    pre = preprocessing_for(cfg.model.architecture)
    return {
        # the formats and size limits of every image (ImageLimits.from_model_config reads
        # them back; a model registered before they existed gets today's defaults)
        **ImageLimits.from_data(cfg.data).model_config(),
        "architecture": cfg.model.architecture,
        "label_names": list(label_names),
        "image_size": cfg.data.image_size,
        "resize_size": cfg.data.stored_short_side,
        "mean": list(pre.mean),
        "std": list(pre.std),
        "dropout": cfg.model.dropout,
        "max_pixels": cfg.data.max_image_pixels,
        "batch_size": SCORE_BATCH_SIZE,
        "max_rows": cfg.serving.max_rows,
        "max_request_bytes": cfg.serving.max_request_bytes,
    }


def guard_scoring_server(max_request_bytes: int) -> bool:
    """Put the request limits that need the HTTP request in front of ``mlflow models serve``:
    wrap ``mlflow.pyfunc.scoring_server.invocations``, which the server's ``/invocations``
    route looks up at each request, so that it answers, before MLflow parses the body,

    - 415 to a request without a Content-Type (MLflow's ``content_type.split`` raises
      ``AttributeError`` on None: a 500), naming the types it takes;
    - 413 to a body over ``max_request_bytes``, naming the limit and the setting.

    MLflow's app reads the whole body before this runs: a reverse proxy's limit
    (docs/using-the-model.md) stops it before that. Idempotent: a second call re-wraps
    MLflow's own function with the new limit.

    Args:
        max_request_bytes: the largest body answered, bytes.

    Returns:
        True when the guard is in place; False outside the scoring server (in-process pyfunc,
        Spark tasks, the registration's own check) or when MLflow's function has another
        signature (logged as a warning).
    """
    if SCORING_APP not in sys.modules:
        return False
    from mlflow.pyfunc import scoring_server

    original = inspect.unwrap(scoring_server.invocations)
    if tuple(inspect.signature(original).parameters) != INVOCATIONS_PARAMETERS:
        log.warning(
            "mlflow.pyfunc.scoring_server.invocations%s is not the function this model guards: "
            "no 413 or 415 from the model (its row and byte limits still hold in predict)",
            inspect.signature(original),
        )
        return False
    scoring_server.invocations = _guarded(original, max_request_bytes, scoring_server)
    log.info(
        "the scoring server answers 415 without a Content-Type and 413 over %d bytes",
        max_request_bytes,
    )
    return True


def _guarded(
    original: Callable[..., Any], max_request_bytes: int, server: Any
) -> Callable[..., Any]:
    """``original`` (MLflow's ``invocations``) behind the Content-Type and body-size checks."""

    @functools.wraps(original)
    def invocations(data: Any, content_type: Any, model: Any, input_schema: Any) -> Any:
        if not content_type or not str(content_type).strip():
            return server.InvocationsResponse(
                response=(
                    "the request has no Content-Type header: send application/json "
                    f"(or one of {', '.join(server.CONTENT_TYPES)})"
                ),
                status=415,
                mimetype="text/plain",
            )
        if data is not None and len(data) > max_request_bytes:
            return server.InvocationsResponse(
                response=(
                    f"the request body is {len(data)} bytes, over this model's limit of "
                    f"{max_request_bytes} (serving.max_request_bytes): send fewer images "
                    "per request"
                ),
                status=413,
                mimetype="text/plain",
            )
        return original(data, content_type, model, input_schema)

    return invocations


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

        check_pillow()  # CVE-2026-25990: a ConfigError names the versions
        tune_this_process()
        config = context.model_config
        self.scorer = Scorer(config, context.artifacts["state_dict"])
        self.label_names = self.scorer.label_names
        self.model = self.scorer.model
        # a model registered before the limits existed gets today's defaults
        defaults = ServingConfig()
        self.max_rows = int(config.get("max_rows", defaults.max_rows))
        self.max_request_bytes = int(config.get("max_request_bytes", defaults.max_request_bytes))
        guard_scoring_server(self.max_request_bytes)

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
        contents = list(frame["image"])
        self.check_request(contents)
        scores = self.score(contents)
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

    def check_request(self, contents: Sequence[Any]) -> None:
        """Refuse a request over ``max_rows`` images or ``max_request_bytes`` bytes of images
        (the ``serving`` settings the model was registered with), before any is decoded.

        Raises:
            mlflow.exceptions.MlflowException: ``INVALID_PARAMETER_VALUE`` (HTTP 400), naming
                the count, the limit and its setting.
        """
        if len(contents) > self.max_rows:
            raise MlflowException(
                f"the request has {len(contents)} images, over this model's limit of "
                f"{self.max_rows} per request (serving.max_rows): send fewer per request",
                error_code=INVALID_PARAMETER_VALUE,
            )
        size = sum(len(c) for c in contents if isinstance(c, (bytes, bytearray, memoryview, str)))
        if size > self.max_request_bytes:
            raise MlflowException(
                f"the request's images are {size} bytes, over this model's limit of "
                f"{self.max_request_bytes} per request (serving.max_request_bytes): send "
                "fewer per request",
                error_code=INVALID_PARAMETER_VALUE,
            )
