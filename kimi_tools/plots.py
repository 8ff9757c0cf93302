"""What a matplotlib figure draws, as plain data, and a PNG writer that leaves the pyplot backend alone.

:func:`figure_facts` reads a figure back (titles, axis labels and limits, legend entries, the data of every line,
bar and image, the texts drawn on it) so that a check can assert on what a reader sees rather than on a file's
existence: the notebook tests and ``kimi ablate``'s tests use it. :func:`save_png` renders a
``matplotlib.figure.Figure`` built without pyplot, so a library call never switches the backend of a notebook
(``%matplotlib inline``) or of a user's script.
"""

from __future__ import annotations

import io
from pathlib import Path
from typing import Any

__all__ = ["figure_facts", "save_png"]


def _floats(values) -> list[float | None]:
    """Plain floats, None where masked or not finite (so that the result is strict JSON)."""
    import numpy as np

    a = np.ma.masked_invalid(np.ma.asarray(values, dtype=np.float64)).ravel()
    return [None if m else float(v) for v, m in zip(a.data, np.ma.getmaskarray(a))]


def figure_facts(fig, max_values: int = 4096) -> dict[str, Any]:
    """The content of ``fig`` (a ``matplotlib.figure.Figure``), JSON-ready.

    Args:
        fig: the figure. max_values: an image with more pixels than this is summarised without its ``values``.

    Returns:
        ``{"suptitle": str, "axes": [...]}``, one entry per axes (colorbars included) with ``title``, ``xlabel``,
        ``ylabel``, ``xscale``, ``yscale``, ``xlim``, ``ylim``, ``xticklabels``, ``yticklabels``, ``legend`` (entry
        texts), ``lines`` (``label``, ``x``, ``y``, ``linestyle``, ``marker``; data coordinates, None for masked or
        non-finite points), ``bars`` (rectangle heights), ``images`` (``shape``; ``masked``: the count of blank
        pixels, masked or not finite; ``min`` / ``max`` of the drawn ones; ``values``, None where blank, for images
        of at most ``max_values`` pixels) and ``texts`` (the strings drawn with ``ax.text`` / ``ax.annotate``).
    """
    from matplotlib.patches import Rectangle

    fig.draw_without_rendering()  # tick labels exist only after a draw
    axes = []
    for ax in fig.axes:
        legend = ax.get_legend()
        axes.append(
            {
                "title": ax.get_title(),
                "xlabel": ax.get_xlabel(),
                "ylabel": ax.get_ylabel(),
                "xscale": ax.get_xscale(),
                "yscale": ax.get_yscale(),
                "xlim": _floats(ax.get_xlim()),
                "ylim": _floats(ax.get_ylim()),
                "xticklabels": [t.get_text() for t in ax.get_xticklabels()],
                "yticklabels": [t.get_text() for t in ax.get_yticklabels()],
                "legend": [t.get_text() for t in legend.get_texts()] if legend is not None else [],
                "lines": [
                    {
                        "label": line.get_label(),
                        "x": _floats(line.get_xdata()),
                        "y": _floats(line.get_ydata()),
                        "linestyle": line.get_linestyle(),
                        "marker": str(line.get_marker()),
                    }
                    for line in ax.get_lines()
                ],
                "bars": [_floats([p.get_height()])[0] for p in ax.patches if isinstance(p, Rectangle)],
                "images": [_image(im.get_array(), max_values) for im in ax.get_images()],
                "texts": [t.get_text() for t in ax.texts],
            }
        )
    suptitle = fig.get_suptitle() if hasattr(fig, "get_suptitle") else ""
    return {"suptitle": suptitle, "axes": axes}


def _image(a, max_values: int) -> dict[str, Any]:
    import numpy as np

    a = np.ma.masked_invalid(np.ma.asarray(a, dtype=np.float64))
    drawn = a.compressed()
    out = {
        "shape": list(a.shape),
        "masked": int(np.ma.count_masked(a)),
        "min": float(drawn.min()) if drawn.size else None,
        "max": float(drawn.max()) if drawn.size else None,
    }
    if a.size <= max_values:
        out["values"] = _nested(a)
    return out


def _nested(a) -> list:
    import numpy as np

    a = np.ma.asarray(a)
    if a.ndim <= 1:
        return _floats(a)
    return [_nested(row) for row in a]


def save_png(fig, path: str | Path, dpi: int = 100) -> None:
    """Write ``fig`` as a PNG, atomically (``kimi.checkpoint.write_atomic``), without touching pyplot's backend.

    Raises:
        OSError: the folder is not writable.
    """
    from kimi.checkpoint import write_atomic

    buf = io.BytesIO()
    fig.savefig(buf, format="png", dpi=dpi)
    write_atomic(Path(path), buf.getvalue())
