"""What runs ranks to measure this machine for the planner: calibration
(:mod:`~plait.plan.measure.calibrate`), its probes, and building a planner layout on real
ranks (:mod:`~plait.plan.measure.execute`). The planner's arithmetic never needs these."""
