"""Model weights between the driver and the executors without the JVM: a fit's trained
weights stream to the driver, inference tasks fetch a model once per Python worker
(:mod:`sparkdl.weights.server` on the driver, :mod:`sparkdl.weights.client` in tasks,
:mod:`sparkdl.weights.codec` for the bytes, pure torch)."""

from sparkdl.weights.endpoint import WeightsEndpoint

__all__ = ["WeightsEndpoint"]
