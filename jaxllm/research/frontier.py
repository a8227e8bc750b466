"""The quality/diversity frontier of a comparison, drawn with matplotlib."""

from __future__ import annotations

import numpy as np

from jaxllm.research.compare import summary

# Measures where lower is better; every other one is maximised.
LOWER_IS_BETTER = frozenset({"nll", "repetition"})


def pareto_front(xs: np.ndarray, ys: np.ndarray, *, x_lower: bool = False, y_lower: bool = False) -> np.ndarray:
    """Indices of the points no other point beats on both axes, ordered by x."""
    x = -np.asarray(xs, float) if x_lower else np.asarray(xs, float)
    y = -np.asarray(ys, float) if y_lower else np.asarray(ys, float)
    keep = [
        i
        for i in range(len(x))
        if not any((x[j] >= x[i]) & (y[j] >= y[i]) & ((x[j] > x[i]) | (y[j] > y[i])) for j in range(len(x)))
    ]
    return np.asarray(sorted(keep, key=lambda i: xs[i]), int)


def frontier(table, x: str = "distinct_2", y: str = "score", *, by: str = "sampler", ax=None):
    """Scatter of each sampler's mean (x, y) with its Pareto frontier; returns the Axes.

    Args:
      table: a `compare` DataFrame.
      x, y: measures (columns); "nll" and "repetition" count as lower-is-better.
      by: the column whose groups are the points.
      ax: a matplotlib Axes to draw on (a new figure otherwise).
    """
    import matplotlib.pyplot as plt

    points = summary(table, by).dropna(subset=[x, y])
    if ax is None:
        _, ax = plt.subplots(figsize=(6, 4))
    ax.scatter(points[x], points[y])
    for name, row in points.iterrows():
        ax.annotate(str(name), (row[x], row[y]), textcoords="offset points", xytext=(4, 4), fontsize=8)
    front = pareto_front(
        points[x].to_numpy(), points[y].to_numpy(), x_lower=x in LOWER_IS_BETTER, y_lower=y in LOWER_IS_BETTER
    )
    ax.plot(points[x].to_numpy()[front], points[y].to_numpy()[front], "--", color="tab:red", label="frontier")
    ax.set_xlabel(x + (" (lower is better)" if x in LOWER_IS_BETTER else ""))
    ax.set_ylabel(y + (" (lower is better)" if y in LOWER_IS_BETTER else ""))
    ax.legend()
    return ax
