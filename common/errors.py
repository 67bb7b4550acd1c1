"""The error every configuration check raises: its message names the key and the fix."""

from __future__ import annotations


class ConfigError(ValueError):
    """The configuration is invalid; the message says which key and how to fix it."""
