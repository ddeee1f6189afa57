"""Figure helpers every report uses: a figure on an Agg canvas (no global pyplot state), a note in
place of data, and saving as PNG."""
from __future__ import annotations

from pathlib import Path

from matplotlib.axes import Axes
from matplotlib.backends.backend_agg import FigureCanvasAgg
from matplotlib.figure import Figure

FIGSIZE = (7.0, 4.0)  # inches; with DPI, ~700x400 px PNGs small enough to commit to docs/
DPI = 100


def new_figure(figsize: tuple[float, float] = FIGSIZE) -> tuple[Figure, Axes]:
    """A figure of ``figsize`` inches at :data:`DPI` on its own Agg canvas, with one axes."""
    fig = Figure(figsize=figsize, dpi=DPI)
    FigureCanvasAgg(fig)
    return fig, fig.add_subplot()


def save_figure(fig: Figure, path: Path | str) -> Path:
    """Lay ``fig`` out tightly and write it to ``path`` as a PNG (parent directories created)."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.tight_layout()
    fig.savefig(path, dpi=DPI, format="png")
    return path


def note(ax: Axes, text: str) -> None:
    """Write ``text`` in the middle of ``ax`` (a plot with nothing to draw says why)."""
    ax.text(0.5, 0.5, text, transform=ax.transAxes, ha="center", va="center", color="0.4", wrap=True)
