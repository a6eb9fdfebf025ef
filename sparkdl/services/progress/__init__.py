"""Live progress of a fit: workers report steps, losses and their log records over an
authenticated socket; the driver draws bars and keeps the history.
"""
