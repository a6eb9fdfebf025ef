"""Compression of what the strategies send: lossy codecs with error feedback (pure,
:mod:`sparkdl.compression.codecs`) and the collectives that exchange their payloads
(:mod:`sparkdl.compression.collectives`: a DDP communication hook, a compressed average)."""
