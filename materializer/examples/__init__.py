"""Example transforms for the materializer's transform hook."""
