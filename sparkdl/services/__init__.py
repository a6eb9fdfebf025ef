"""The servers a fit runs on the driver and the clients that reach them over the wire:
the parameter server (:mod:`sparkdl.services.ps`), live progress and worker logs
(:mod:`sparkdl.services.progress`) and model weights (:mod:`sparkdl.services.weights`).
"""
