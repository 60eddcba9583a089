"""The measuring half of `pdserve plan` (the planner is `pdserve.server.plan`): `plan profile` (`measure.py`,
with `fit.py`) and `plan validate` (`validate.py`) drive a live cluster with the load generator's clients, the
host's CPU read from /proc (`procstat.py`) and each process pinned to its core (`pinning.py`). They reach
`pdserve plan` through the `pdserve.plan.commands` entry points (pyproject.toml). Beside them, their inputs and
results: `profile-cpu.json`, `validation-cpu.json`, `example-plans.json`.
"""
