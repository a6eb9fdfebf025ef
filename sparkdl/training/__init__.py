"""One worker's training, with torch alone: the loop, the strategy contract and its
registry, the model/optimizer/loss factory, guards, hooks, schedules, step planning,
validation, checkpoint contents and the trial step of the preflight. No Spark, no sockets.
"""
