"""The materializer: Kafka partitions -> Spark -> a checkpointed local store, served over HTTP.

Issue #3 builds the node; for now this package holds the Kafka helpers it will stand on.
"""
