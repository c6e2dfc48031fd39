"""`SecretStr`: a secret that no repr, log line or traceback shows (a ground module: imports nothing)."""

from __future__ import annotations


class SecretStr:
    """A secret that no repr, log line or traceback shows; `get_secret_value()` reads it.

    Pydantic's `SecretStr` interface without importing Pydantic, so that a command that only asks
    the read service starts fast; a Pydantic `SecretStr` given to `Settings` becomes one of these.
    """

    __slots__ = ('_secret_value',)

    def __init__(self, secret_value: str) -> None:
        """Hold `secret_value`."""
        self._secret_value = secret_value

    def get_secret_value(self) -> str:
        """The secret itself."""
        return self._secret_value

    def __repr__(self) -> str:
        return "SecretStr('**********')"

    def __str__(self) -> str:
        return '**********' if self._secret_value else ''

    def __len__(self) -> int:
        return len(self._secret_value)

    def __eq__(self, other: object) -> bool:
        return isinstance(other, SecretStr) and other._secret_value == self._secret_value

    def __hash__(self) -> int:
        return hash(self._secret_value)
