"""`python -m pdserve.benchmarks.gpu`: the GPU run (run.py) where pdserve is installed; from a bare checkout,
`python3 benchmarks/gpu.py`."""

import sys

from pdserve.benchmarks.gpu.run import main

sys.exit(main())
