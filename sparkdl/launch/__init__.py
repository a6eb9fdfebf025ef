"""Your own training code on Spark: ``sparkdl.run`` (:mod:`~sparkdl.launch.run`: your
function with ``ctx`` on every worker) and ``sparkdl.TorchDistributor``
(:mod:`~sparkdl.launch.distributor`: PySpark's, drop-in, a function or script run as
torchrun would)."""
