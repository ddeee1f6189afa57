"""What ``autotune serve`` lets a client do: the API key, the largest body, the longest request.

Kept apart from the machinery so the CLI reads the defaults without importing the server.
"""
from __future__ import annotations

from dataclasses import dataclass, field

from autotune.errors import SettingError

API_KEY_ENV = "AUTOTUNE_API_KEY"  # the key when --api-key is not given (keeps it out of `ps` listings)


@dataclass(frozen=True)
class Limits:
    """What a client may do: ``serve --api-key``, ``--max-body-bytes``, ``--request-timeout``."""

    # None: /v1/* is open (the default bind is loopback only); repr=False keeps it out of logged configs
    api_key: str | None = field(default=None, repr=False)
    max_body_bytes: int = 1 << 20  # a larger body gets 413 before it is parsed
    request_timeout_s: float = 600.0  # queued + decoding; past it: 504 and the worker stops the request

    def __post_init__(self) -> None:
        if self.api_key is not None and not (self.api_key.isascii() and self.api_key.isprintable()
                                             and self.api_key.strip() == self.api_key and self.api_key):
            raise SettingError("--api-key must be non-empty printable ASCII without surrounding spaces "
                               "(it travels in an HTTP header)")
        if self.max_body_bytes < 1:
            raise SettingError(f"--max-body-bytes must be at least 1, got {self.max_body_bytes}")
        if not self.request_timeout_s > 0:
            raise SettingError(f"--request-timeout must be a positive number of seconds, got {self.request_timeout_s}")
