"""Your own training code on Spark: :class:`~sparkdl.run.distributor.TorchDistributor`
(PySpark's, drop-in: a function or script run as torchrun would)."""
