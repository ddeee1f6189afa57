"""The online tuner, cost model, persistence, CLI and server (the tuner lands in a later issue)."""
