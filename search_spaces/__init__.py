"""The Strategy value and its encodings into Optuna parameters."""
from search_spaces.errors import StrategyError
from search_spaces.layer_plan import LayerPlan, easyspec_plan, uniform_skip_plan
from search_spaces.strategy import PLAIN, SCHEMA_VERSION, Strategy

__all__ = ["PLAIN", "SCHEMA_VERSION", "LayerPlan", "Strategy", "StrategyError", "easyspec_plan", "uniform_skip_plan"]
