"""Adaptive serving: drift per route, plain fallback, re-tuning on live traffic, new routes."""
