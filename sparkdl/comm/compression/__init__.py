"""Compression of what the strategies send: lossy codecs with error feedback (pure,
:mod:`sparkdl.comm.compression.codecs`) and the collectives that exchange their payloads
(:mod:`sparkdl.comm.compression.collectives`: a DDP communication hook, a compressed average)."""
