"""One worker, assembled: device, process groups, model, optimizer, checkpoint restore,
strategy, feed, hooks and progress built in one place and torn down by one exit stack
(:mod:`~sparkdl.worker.assembly`); the advisor's probe on a worker; the device choice.
"""
