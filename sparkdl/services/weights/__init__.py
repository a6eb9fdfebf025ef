"""Model weights between the driver and the executors without the JVM: a fit's trained
weights stream to the driver, inference tasks fetch a model once per Python worker
(:mod:`sparkdl.services.weights.server` on the driver, :mod:`sparkdl.services.weights.client` in tasks,
:mod:`sparkdl.services.weights.codec` for the bytes, pure torch)."""

from sparkdl.services.weights.endpoint import WeightsEndpoint

__all__ = ["WeightsEndpoint"]
