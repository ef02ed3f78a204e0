"""Adapters: publish the Redis contract for partitioned services kroute did not build."""
