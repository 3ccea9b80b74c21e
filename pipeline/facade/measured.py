"""The measurement part of the `Pipeline` API: the last step's trace, the calibration made
from measured steps, the predicted step (simulate), re-partitioning (rebalance) and
re-synthesising the schedule (resynthesize), all delegated to pipeline.facade.measurement."""

from __future__ import annotations

from pipeline.facade.measurement import Measurement
from pipeline.planning.calibration import Calibration, Rebalance
from pipeline.planning.costs import StageCosts
from pipeline.planning.synthesis import Resynthesis
from scheduler import Schedule, Timeline


class Measured:
    """What a Pipeline offers about its measured and predicted steps (`pipeline.api.Pipeline`
    sets `_measure`)."""

    _measure: Measurement

    @property
    def trace(self) -> Timeline | None:
        """The measured Timeline of the last successful step (None before the first step).
        Times are host perf_counter seconds; on CUDA they time kernel launches, not kernels."""
        return self._measure.trace

    def profiled_costs(self) -> StageCosts:
        """Per-stage profiled seconds for one microbatch (profiling now, on one microbatch of
        the first batch, if the plan was not balanced by profile). Under torch.distributed the
        costs are those global rank 0 measured before the model was split."""
        return self._measure.profiled_costs()

    def simulate(
        self, schedule: Schedule | str | None = None, comm: float | None = None,
        calibrated: bool = True,
    ) -> Timeline:
        """The predicted Timeline of one step (pipeline.planning.costs.predict). Costs are the
        calibrated ones (`calibration`: measured action times, runtime overhead per action and
        transfer latency; the median of the steps predicted from each measured step, see
        `pipeline.planning.calibration.predict_calibrated`) once steps have been measured and
        `calibrated`, else the profiled ones. `schedule`: another Schedule or schedule name to
        predict on this model (default: the one being run); for a different stage count the
        (calibrated) graph is re-partitioned as ``balance`` says. `comm`: seconds per
        cross-rank transfer (default: the calibrated latency, else 0)."""
        return self._measure.simulate(schedule, comm, calibrated)

    @property
    def calibration(self) -> Calibration | None:
        """Measured costs from the recorded step traces (pipeline.planning.calibration), or None
        before the second step (the first is warm-up)."""
        return self._measure.calibration

    def rebalance(self, threshold: float = 0.05) -> Rebalance:
        """Re-partition from the measured costs when that cuts the calibrated predicted step
        by more than `threshold` (the stage modules are rebuilt; they share the model's
        parameters, so an optimizer over ``pipe.parameters()`` keeps working). Returns and
        logs the Rebalance report (also kept as ``pipe.rebalanced``). One process only: under
        torch.distributed the other processes no longer hold the weights a new cut needs."""
        return self._measure.rebalance(threshold)

    @property
    def rebalanced(self) -> Rebalance | None:
        """The report of the last `rebalance` (automatic or on demand), else None."""
        return self._measure.rebalanced

    def resynthesize(self, threshold: float = 0.05) -> Resynthesis:
        """Synthesise a schedule from the measured costs within the memory the running one
        may hold (``memory_limit``, else its peak in-flight activations) and run it from the
        next step if it cuts the calibrated predicted step by more than `threshold`. One
        process only. Returns the report, also kept as ``pipe.resynthesized``."""
        return self._measure.resynthesize(threshold)

    @property
    def resynthesized(self) -> Resynthesis | None:
        """The report of the last `resynthesize` (automatic or on demand), else None."""
        return self._measure.resynthesized
