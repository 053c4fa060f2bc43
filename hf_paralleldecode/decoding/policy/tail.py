"""The tail of a static batch: how much of a shape's per-step rate is left once its rows finish apart.

``generate``'s batch is static: rows that accept more finish first, and the batch runs its last steps with fewer
rows, on a CPU at nearly a full step's cost (the bench's ``tail``). With ``mu`` and ``sigma`` the mean and spread of a
row's tokens per step, ``n = remaining / mu`` steps for a typical row: the rows finish over ``n +- w`` steps,
``w = z * sigma * sqrt(n) / mu`` (``z``: the expected largest of ``rows`` standard normals, :func:`expected_max`), so
the batch runs ``n - w`` full steps and ``2 w`` draining ones at the mean time of a step of 1 .. rows - 1 rows. The
factor (:func:`tail_factor`) is ``n`` full steps' time over that: nothing lost for one row or a shape every row
commits alike (the plain step), most for a deep shape at a batch whose small steps cost what full ones cost.

What it deliberately does not know
    Where ``mu``, ``sigma`` and the step times come from (:mod:`.rule`, :mod:`.times`).
"""

from __future__ import annotations

import functools
from statistics import NormalDist

__all__ = ["expected_max", "tail_factor"]


@functools.cache
def expected_max(n: int) -> float:
    """The expected largest of ``n`` standard normal draws (Blom's approximation; 0 for one)."""
    return 0.0 if n < 2 else NormalDist().inv_cdf((n - 0.375) / (n + 0.25))


def tail_factor(rows: int, remaining: float, mu: float, sigma: float, full: float,
                smaller: list[float | None]) -> float:
    """The share of a shape's per-step rate left over a whole static batch of ``rows`` (>= 2) active rows with
    ``remaining`` (> 0) new tokens each on average (module docstring). ``mu`` (> 0) / ``sigma``: the mean and spread of
    a row's tokens per step; ``full``: the shape's step time at ``rows``; ``smaller``: its step time in each smaller
    batch-size bucket, from one row up (``None``: not measured, ``full`` stands in)."""
    n = remaining / mu
    w = min(expected_max(rows) * sigma * n ** 0.5 / mu, n)
    # a draining batch passes through every row count below this one: the mean step time over 1 .. rows - 1,
    # each from its bucket's time (this bucket's where a smaller one is not measured)
    total = 0.0
    for k, t in enumerate([*smaller, full]):
        span = min(2 ** (k + 1), rows) - 2 ** k
        total += span * min(t if t is not None else full, full)
    drain = total / (rows - 1)
    # (step time proportional to the rows: no loss; a bucket's time stands for its smallest batch, so the
    # estimate can dip below that, which a tail never gains)
    return min(1.0, n * full / ((n - w) * full + 2 * w * drain))
