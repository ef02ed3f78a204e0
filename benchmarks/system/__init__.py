"""The system benchmark (`python -m benchmarks.system_bench`).

`harness` starts its cluster; `hop`, `freshness`, `survive`, `staleness`, `restart` and `soak`
measure one claim each; `report` turns the figures into plots and the RESULTS.md section.
"""
