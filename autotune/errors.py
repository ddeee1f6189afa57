"""Which exceptions are the user's input being wrong (one line, exit 2) rather than our bug."""
from runtime.errors import RuntimeUserError
from search_spaces.errors import SpaceError, StrategyError
from studies.errors import TaskError


class CliError(ValueError):
    """Bad command-line usage that argparse itself cannot see."""


class StorageError(ValueError):
    """The strategy store cannot be used: bad URL, unknown driver, unreachable server, unknown id."""


class ExportError(ValueError):
    """A stored strategy uses something the requested engine format cannot express."""


USER_ERRORS: tuple[type[Exception], ...] = (
    RuntimeUserError, StrategyError, SpaceError, TaskError, CliError, StorageError, ExportError,
)
