"""The Strategy value and its encodings into Optuna parameters."""
from search_spaces.errors import SpaceError, StrategyError
from search_spaces.layer_plan import LayerPlan, easyspec_plan, uniform_skip_plan
from search_spaces.spaces import SPACES, SearchSpace, SpaceContext, get_space, uniform_strategy
from search_spaces.strategy import PLAIN, SCHEMA_VERSION, Strategy

__all__ = [
    "PLAIN", "SCHEMA_VERSION", "SPACES", "LayerPlan", "SearchSpace", "SpaceContext", "SpaceError", "Strategy",
    "StrategyError", "easyspec_plan", "get_space", "uniform_skip_plan", "uniform_strategy",
]
