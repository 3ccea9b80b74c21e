"""Pictures and traces of hybridpipe runs: schedule timelines, memory curves, partition plots,
loss curves (matplotlib, headless: Figures are built without pyplot) and Chrome/Perfetto trace
export."""

from viz.partition import PlanLike, plot_partition
from viz.timeline import plot_comparison, plot_loss, plot_memory, plot_timeline
from viz.trace import to_chrome_trace

__all__ = [
    "PlanLike",
    "plot_comparison",
    "plot_loss",
    "plot_memory",
    "plot_partition",
    "plot_timeline",
    "to_chrome_trace",
]
