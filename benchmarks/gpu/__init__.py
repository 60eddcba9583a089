"""pdserve on one GPU: the run (`run.py`, started as `python3 benchmarks/gpu.py`) and its stages' parts: start-up
from a bare checkout (`boot.py`), correctness (`checks.py`), decode (`decode.py`), the Triton kernels
(`kernels.py`), prefill MFU (`prefill.py`) and the served pair (`served.py`)."""
