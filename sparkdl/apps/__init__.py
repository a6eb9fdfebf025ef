"""The bundled applications: the main training job and the ETL-to-training job (what
``jobs/*.py`` call), the data sets and small models they ship with, and the whole
settings table including the jobs' own sections (``python -m sparkdl settings``).
"""
