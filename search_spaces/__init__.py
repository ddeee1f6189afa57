"""The Strategy value and its encodings into Optuna parameters."""
from search_spaces.strategy import PLAIN, SCHEMA_VERSION, Strategy, StrategyError

__all__ = ["PLAIN", "SCHEMA_VERSION", "Strategy", "StrategyError"]
