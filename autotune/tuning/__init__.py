"""Tuning: the online tuner (hooks and decisions), racing and probation, the time budget, the
objective, matchness, the measured cost model, and ``run_study``."""
