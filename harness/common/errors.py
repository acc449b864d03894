"""Errors every layer raises and prints the same way."""

from __future__ import annotations


class ConfigError(ValueError):
    """A configuration that cannot run; the message is one line that says what would be right."""


def one_line(e: BaseException) -> str:
    """An error as one line: a ``ConfigError``'s message alone (it already says what would be right), any other
    error's type and message."""
    msg = " ".join(str(e).split()) or "(no message)"
    return msg if isinstance(e, ConfigError) else f"{type(e).__name__}: {msg}"
