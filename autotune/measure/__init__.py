"""Measurements: bench (methods side by side), profile (step costs), diagnose (fuzzy attention),
and the replay client of a running server."""
