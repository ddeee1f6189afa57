"""Errors of the search_spaces package."""


class StrategyError(ValueError):
    """A strategy field holds an invalid value; the message names field, value and allowed range."""


class SpaceError(ValueError):
    """An unknown search space, or a strategy/parameters that are not a point of a space."""
