"""Shared look of every hybridpipe figure: the colour-blind-safe palette, per-chunk shading,
time-unit scaling and writing a Figure to disk by file extension."""

from __future__ import annotations

from pathlib import Path

from matplotlib.colors import to_hex, to_rgb
from matplotlib.figure import Figure

from scheduler import Op

# Okabe & Ito (2008), "Color Universal Design": distinguishable under the common colour-vision
# deficiencies. F/B/W take the three most separated hues; stages and ranks cycle the rest.
OKABE_ITO = (
    "#E69F00",  # orange
    "#56B4E9",  # sky blue
    "#009E73",  # bluish green
    "#F0E442",  # yellow
    "#0072B2",  # blue
    "#D55E00",  # vermillion
    "#CC79A7",  # reddish purple
    "#000000",  # black
)
OP_COLORS: dict[Op, str] = {Op.F: "#56B4E9", Op.B: "#E69F00", Op.W: "#009E73"}
OP_NAMES: dict[Op, str] = {Op.F: "forward", Op.B: "backward", Op.W: "weight grad"}
# Stage (and rank) colours: the whole palette, so 8 pipeline stages get 8 colours.
STAGE_COLORS = (
    "#0072B2",
    "#E69F00",
    "#009E73",
    "#CC79A7",
    "#56B4E9",
    "#D55E00",
    "#F0E442",
    "#000000",
)
STAGE_MARKERS = ("o", "s", "D", "^", "v")
SAVE_FORMATS = (".png", ".svg", ".pdf")


def stage_color(stage: int) -> str:
    """Colour of pipeline stage `stage` (cycles after eight stages; see stage_marker)."""
    return STAGE_COLORS[stage % len(STAGE_COLORS)]


def stage_marker(stage: int) -> str:
    """Marker of stage `stage` in graph drawings: a new shape each time the colours cycle."""
    return STAGE_MARKERS[(stage // len(STAGE_COLORS)) % len(STAGE_MARKERS)]


def chunk_color(op: Op, chunk: int) -> str:
    """Colour of `op` on a rank's `chunk`-th virtual stage: the op's hue, darkened by chunk so
    virtual stages stay apart while the op stays recognisable."""
    r, g, b = to_rgb(OP_COLORS[op])
    factor = 0.62**chunk  # chunk 0 = base colour; each further chunk about 40% darker
    return to_hex((r * factor, g * factor, b * factor))


def text_color(background: str) -> str:
    """Black or white, whichever reads better on `background` (WCAG relative luminance)."""

    def channel(c: float) -> float:
        return c / 12.92 if c <= 0.03928 else ((c + 0.055) / 1.055) ** 2.4

    r, g, b = (channel(c) for c in to_rgb(background))
    luminance = 0.2126 * r + 0.7152 * g + 0.0722 * b
    return "black" if luminance > 0.179 else "white"


def time_scale(span: float, unit: str | None) -> tuple[float, str]:
    """(factor, axis label) that turn raw times into readable numbers.

    unit "s" (measured or profiled seconds) picks s, ms or us from the span; any other unit is
    kept as given; None means abstract cost units.
    """
    if unit is None:
        return 1.0, "time (cost units)"
    if unit == "s":
        if span >= 1.0:
            return 1.0, "time (s)"
        if span >= 1e-3:
            return 1e3, "time (ms)"
        return 1e6, "time (µs)"
    return 1.0, f"time ({unit})"


def format_time(value: float, unit: str | None) -> str:
    """`value` (in `unit`) as short text, e.g. "12.5 ms" or "13" (cost units)."""
    factor, label = time_scale(value, unit)
    suffix = label[label.find("(") + 1 : -1] if unit is not None else ""
    return f"{value * factor:.3g} {suffix}".rstrip()


def save(fig: Figure, path: str | Path | None) -> Figure:
    """Write `fig` to `path` (format from the extension, parent folders created); return it."""
    if path is None:
        return fig
    target = Path(path)
    if target.suffix.lower() not in SAVE_FORMATS:
        raise ValueError(
            f"cannot write figure to {str(target)!r}: unknown extension {target.suffix!r}; "
            f"use one of {', '.join(SAVE_FORMATS)}"
        )
    target.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(target, dpi=150)
    return fig
