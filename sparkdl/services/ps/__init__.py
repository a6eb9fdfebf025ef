"""The parameter server hosted on the driver: a pure versioned store of the shards
(:mod:`~sparkdl.services.ps.store`), its wire protocol, the server that owns the socket,
and the worker-side client.
"""
