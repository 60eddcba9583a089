"""`pdserve plan`: which tier on which hardware, how many of each, at what cost per million tokens.

- `workload.py`: the requests (a trace file, or `pdserve bench`'s distributions and arrivals: `bench_flags.py`,
  `datasets.py`, `arrivals.py`).
- `run_summary.py`: what each request measured and the run's summary, as `pdserve bench` prints it.
- `profile.py`: a tier profile (seconds per prefill step, decode step, KV handoff) and its file.
- `clock.py`: the virtual clock and its event queue.
- `contention.py`: the workers, coordinator and client sharing a host's cores.
- `workers.py`: prefill, decode and colocated workers around the real schedulers.
- `cluster.py`: the coordinator's side (the real Router, pickers and expected-wait admission) and a run.
- `simulate_cli.py` (`plan simulate`), `catalog.py` + `catalog.json`, `roofline.py`, `size.py` (`plan size`),
  `overlay.py`, `cli.py`.
`plan profile` and `plan validate` drive a live cluster with the benchmarks' load generator: they live in
benchmarks/plan/ and reach `pdserve plan` through an entry point (`cli.py` MEASURING).
"""
