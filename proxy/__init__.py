"""The proxy: key -> partition -> replica -> forward (issue #5).

In place so far, the pure core: `routing` (the immutable snapshot built from the Redis contract)
and `choice` (which replica answers, within a lag budget, and why the others do not). The
listener, the Redis watcher and the pooled forwarder come next.
"""
