"""Tables (markdown + CSV) and plots (PNG) for experiment results."""

from __future__ import annotations

import csv
import math
import os
from collections.abc import Sequence
from pathlib import Path
from types import ModuleType
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from matplotlib.figure import Figure


def _fmt(value: Any) -> str:
    if value is None or (isinstance(value, float) and math.isnan(value)):
        return "–"
    if isinstance(value, float):
        return f"{value:.4g}" if abs(value) < 1e4 else f"{value:.0f}"
    return str(value)


def _escape(text: str) -> str:
    return text.replace("|", "\\|")


def markdown_table(rows: Sequence[dict[str, Any]], columns: Sequence[str]) -> str:
    """A GitHub markdown table of ``rows`` restricted to ``columns`` (missing cells shown as –; a
    "|" in a name or cell is escaped, so it cannot split the column)."""
    lines = ["| " + " | ".join(map(_escape, columns)) + " |",
             "|" + "|".join("---" for _ in columns) + "|"]
    lines += ["| " + " | ".join(_escape(_fmt(row.get(c))) for c in columns) + " |" for row in rows]
    return "\n".join(lines) + "\n"


def write_csv(
    rows: Sequence[dict[str, Any]], columns: Sequence[str], path: str | os.PathLike
) -> Path:
    """Write ``rows`` as CSV with a header; returns the path."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=list(columns), extrasaction="ignore")
        writer.writeheader()
        writer.writerows(rows)
    return path


def pyplot() -> ModuleType:
    """matplotlib's pyplot on the file-only Agg backend (no display needed)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def save_figure(fig: Figure, path: str | os.PathLike) -> Path:
    """Lay out ``fig``, save it to ``path`` (parents created) and close it (pyplot keeps every
    open figure: a report of many plots would hold them all); returns the path."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.tight_layout()
    fig.savefig(path)
    pyplot().close(fig)
    return path


def plot_curves(
    curves: dict[str, tuple[Sequence[float], Sequence[float]]], path: str | os.PathLike,
    xlabel: str, ylabel: str, title: str = "",
    reference_points: dict[str, tuple[float, float]] | None = None, logy: bool = False,
) -> Path:
    """Line plot of ``{label: (xs, ys)}``; ``reference_points`` {label: (x, y)} drawn as hollow
    markers."""
    plt = pyplot()
    fig, ax = plt.subplots(figsize=(6.4, 4.2), dpi=120)
    colors = {}
    for label, (xs, ys) in curves.items():
        (line,) = ax.plot(xs, ys, marker="o", ms=3, label=label)
        colors[label] = line.get_color()
    for label, (x, y) in (reference_points or {}).items():
        ax.plot([x], [y], marker="*", ms=11, mfc="none", color=colors.get(label.split(" ")[0], "k"),
                linestyle="none", label=f"{label} (paper)")
    ax.set_xlabel(xlabel)
    ax.set_ylabel(ylabel)
    if logy:
        ax.set_yscale("log")
    ax.set_title(title)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    out = save_figure(fig, path)
    plt.close(fig)
    return out

