"""Least squares with non-negative coefficients (a step never gets faster with more work), for
`measure.py`'s rows: a column whose coefficient comes out negative is dropped and the rest refit.
Relative (the default): each row's error is weighed by 1 / its measured time, so a 5 ms step counts as
much as a 140 ms one (absolute least squares fits the big batches and leaves the small ones, the low-load
regime, off by 3x)."""

from __future__ import annotations

import numpy as np


def nonneg_fit(columns: dict[str, list[float]], target: list[float], relative: bool = True) -> dict[str, float]:
    """{column: coefficient >= 0} minimising the squared (relative) error of sum(coef * column) against target."""
    if not target:
        raise ValueError("nothing measured to fit")
    names = list(columns)
    kept = list(names)
    y = np.asarray(target, dtype=np.float64)
    w = 1.0 / y if relative else np.ones_like(y)
    y = y * w
    while kept:
        a = np.stack([np.asarray(columns[n], dtype=np.float64) * w for n in kept], axis=1)
        coef, *_ = np.linalg.lstsq(a, y, rcond=None)
        if (coef >= 0).all():
            out = dict.fromkeys(names, 0.0)
            out.update({n: float(c) for n, c in zip(kept, coef)})
            return out
        kept.pop(int(np.argmin(coef)))
    return dict.fromkeys(names, 0.0)
