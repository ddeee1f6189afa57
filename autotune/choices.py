"""The per-request strategy override's named choices, shared by the server and its clients.

A request's ``{"autotune": {"strategy": ...}}`` is one of ``STRATEGY_CHOICES`` or a stored strategy id
(``autotune strategies list``).
"""
from __future__ import annotations

STRATEGY_CHOICES: tuple[str, ...] = ("auto", "plain", "default")
