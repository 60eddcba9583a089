"""`pdserve plan`: which tier on which hardware, how many of each, at what cost per million tokens.

- `workload.py`: the requests (a trace file, or `pdserve bench`'s distributions and arrivals).
- `profile.py`: a tier profile (seconds per prefill step, decode step, KV handoff) and its file.
- `clock.py`: the virtual clock and its event queue.
- `workers.py`: prefill, decode and colocated workers around the real schedulers.
- `cluster.py`: the coordinator's side (the real Router, pickers and expected-wait admission) and a run.
- `measure.py` (`plan profile`), `catalog.py` + `catalog.json`, `roofline.py`, `size.py`, `overlay.py`,
  `validate.py`, `cli.py`.
"""
