"""The proxy: key -> partition -> replica -> forward (`python -m proxy`).

Modules, in the direction data flows: `settings` (KROUTE_* variables), `watcher` (Redis ->
`routing.build_snapshot`, the immutable table), `listener` (client connections, limits),
`routes` (which request is keyed, and by what), `handler` (route, partition, `choice`),
`exchange` (send, fail over and hedge within `retry_budget`, answer), `upstream` (pooled
keep-alive connections to nodes), `health` (ejections and probes), `outliers` (ejection on
consecutive 5xx, capped), `metrics`, `status` and `admin` (the
admin listener), `main` (the composition root).
"""
