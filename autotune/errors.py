"""Which exceptions are the user's input being wrong (one line, exit 2) rather than our bug."""
from runtime.errors import RuntimeUserError
from search_spaces.errors import StrategyError
from studies.errors import TaskError


class CliError(ValueError):
    """Bad command-line usage that argparse itself cannot see."""


USER_ERRORS: tuple[type[Exception], ...] = (RuntimeUserError, StrategyError, TaskError, CliError)
