"""Where models and pipelines saved by sparkdl 0.1 name their classes.

Spark ML metadata records a stage's class by its import path, and 0.1 wrote
``sparkdl.estimator.TorchModel`` and ``sparkdl.estimator.TorchEstimator``. The classes
live in :mod:`sparkdl.ml.estimator` now; this alias keeps those saved directories loading
(``PipelineModel.load``, ``DefaultParamsReader``). New code imports from ``sparkdl``.
"""

from sparkdl.ml.estimator import TorchEstimator, TorchModel

__all__ = ["TorchEstimator", "TorchModel"]
