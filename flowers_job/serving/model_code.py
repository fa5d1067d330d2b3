"""MLflow "models from code" entry: the file logged as the pyfunc model's ``python_model``.

MLflow runs this file when the model loads, instead of unpickling an object.
"""

from mlflow.models import set_model

from flowers_job.serving.pyfunc_model import FlowersClassifierModel

set_model(FlowersClassifierModel())
