"""How bytes move between workers: process groups and their rendezvous, one host's
shared memory, the two-level hierarchy, compression with error feedback, the parameter
server's shared areas and endpoint, and what a collective sends. Torch only; no Spark.
"""
