"""kroute's product shell: the run command and the embedded services it starts.

This is the top layer: it may import proxy/, materializer/ and partitioner/; none of them
imports it (import-linter checks this).
"""
