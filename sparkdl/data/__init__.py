"""Spark's Arrow record batches to tensors, on the executors: typed inputs and their
checks (pure), batching and shuffling, the per-worker epoch cache for epochs 2+ in pages
a Python worker reuses, and prefetch (pinned memory on GPU). No Spark, no sockets.
"""
