"""The hostile run (`python -m pdserve.benchmarks.hostile`, `run.py`): bad input at every port (`families.py`,
built from `payloads.py`, sent by `send.py`), no process may die, no 5xx, a greedy stream keeps its pace."""
