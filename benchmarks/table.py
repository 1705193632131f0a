"""Cells of the benchmarks' plain-text tables."""
from __future__ import annotations

import numpy as np


def cell(x, spec=".3f") -> str:
    """``x`` formatted with ``spec``; ``-`` for None or a non-finite float."""
    if x is None or (isinstance(x, float) and not np.isfinite(x)):
        return "-"
    return format(x, spec)
