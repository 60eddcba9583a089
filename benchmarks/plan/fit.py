"""Least squares with non-negative coefficients (a step never gets faster with more work), for
`measure.py`'s rows: a column whose coefficient comes out negative is dropped and the rest refit."""

from __future__ import annotations

import numpy as np


def nonneg_fit(columns: dict[str, list[float]], target: list[float]) -> dict[str, float]:
    """{column: coefficient >= 0} minimising the squared error of sum(coef * column) against target."""
    if not target:
        raise ValueError("nothing measured to fit")
    names = list(columns)
    kept = list(names)
    y = np.asarray(target, dtype=np.float64)
    while kept:
        a = np.stack([np.asarray(columns[n], dtype=np.float64) for n in kept], axis=1)
        coef, *_ = np.linalg.lstsq(a, y, rcond=None)
        if (coef >= 0).all():
            out = dict.fromkeys(names, 0.0)
            out.update({n: float(c) for n, c in zip(kept, coef)})
            return out
        kept.pop(int(np.argmin(coef)))
    return dict.fromkeys(names, 0.0)
