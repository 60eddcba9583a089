"""`python -m pdserve.benchmarks.hostile`: the hostile run (run.py)."""

import sys

from pdserve.benchmarks.hostile.run import main

sys.exit(main())
