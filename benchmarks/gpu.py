"""`python3 benchmarks/gpu.py --out "$OUT"`: the GPU run (benchmarks/gpu/run.py) from a bare checkout, as the
device runs it, and the file each of its stages' processes runs.

As a file it finds the `pdserve` package in the checkout itself (`gpu/boot.py`'s `checkout_package`: nothing
installed), then runs `pdserve.benchmarks.gpu.run`; where pdserve is installed, `python -m pdserve.benchmarks.gpu`
is the same run. It is only a file to run: `import pdserve.benchmarks.gpu` is the package gpu/ beside it.
"""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

if __name__ == "__main__":
    _here = Path(__file__).resolve().parent
    sys.path[:] = [p for p in sys.path if Path(p or ".").resolve() != _here]  # benchmarks/ is no package root
    _spec = importlib.util.spec_from_file_location("pdserve_gpu_boot", _here / "gpu" / "boot.py")
    _boot = importlib.util.module_from_spec(_spec)
    _spec.loader.exec_module(_boot)
    _boot.checkout_package()

    from pdserve.benchmarks.gpu.run import main

    sys.exit(main())
