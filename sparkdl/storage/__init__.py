"""Files on any path Spark or Hadoop reaches (local, HDFS, S3, DBFS), and atomic
checkpoints: written whole or not at all, and the latest complete one found on resume.
"""
