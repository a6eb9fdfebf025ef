"""The strategy advisor: which strategy, tau and compression suit this cluster.

:mod:`~sparkdl.advisor.costmodel` prices a step (compute plus communication, by strategy,
on a link of given speed); :mod:`~sparkdl.advisor.predict` turns what a probe measured
into predicted samples/s and a recommendation (both pure); :mod:`~sparkdl.advisor.advise`
runs the probe on the real cluster from the driver (``sparkdl.advise``).
"""
