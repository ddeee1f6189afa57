"""The library's errors: what the user's input or environment got wrong, one line each.

Library modules raise an ``AutotuneError`` subclass named for what went wrong; only ``autotune.cli``
turns an error of ``USER_ERRORS`` into one line and exit status 2, and only it raises ``CliError``.
"""
from runtime.errors import RuntimeUserError
from search_spaces.errors import SpaceError, StrategyError
from studies.errors import TaskError


class AutotuneError(ValueError):
    """Base of the ``autotune`` package's user-facing errors: the message says what to do."""


class SettingError(AutotuneError):
    """A setting is out of its range or contradicts another (server, bench, profile, replay, adaptive)."""


class MethodError(AutotuneError):
    """A bench method, replay mode or peer cannot run as asked (unknown, or missing what it needs)."""


class RemoteError(AutotuneError):
    """A server we talk to is unreachable or answered something we cannot use."""


class StorageError(AutotuneError):
    """The strategy store cannot be used: bad URL, unknown driver, unreachable server, unknown id."""


class ExportError(AutotuneError):
    """A stored strategy uses something the requested engine format cannot express."""


class CliError(AutotuneError):
    """Bad command-line usage that argparse itself cannot see; raised only inside ``autotune.cli``."""


USER_ERRORS: tuple[type[Exception], ...] = (
    RuntimeUserError, StrategyError, SpaceError, TaskError, AutotuneError,
)
