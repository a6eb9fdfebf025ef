"""Everything that touches Spark: the session, the checks before a stage (cluster,
executors' Python, preflight), launching the barrier stage and its task, hosting the
driver's servers for one fit, watching the stage, inference with ``mapInArrow``, RDD input,
GPU resource profiles. The only layer below ``ml/`` that imports pyspark.
"""
