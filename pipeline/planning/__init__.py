"""Planning: from a captured graph and settings to stages, schedule and predicted costs (planner,
auto-plan search, cost model, calibration, settings checks, microbatch splitting)."""
