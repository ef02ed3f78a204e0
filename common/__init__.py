"""What several kroute components must agree on, in one place each.

- `settings`: the KROUTE_* environment-variable settings base every component builds on.

proxy/ and materializer/ import this package; it imports neither of them (import-linter).
"""
