"""The ``pyspark.ml`` face of sparkdl: ``TorchEstimator`` and ``TorchModel``
(:mod:`~sparkdl.ml.estimator`), their Spark ML persistence, MLflow tracking of a fit and
the plot of its history.
"""
