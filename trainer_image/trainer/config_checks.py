"""Shared pieces of the config sections: the error type and the checks every section uses."""

from __future__ import annotations

from typing import Any


class ConfigError(ValueError):
    """A configuration value is missing or invalid; the message says what to change."""


def positive(section: Any, name: str, keys: tuple[str, ...]) -> None:
    for key in keys:
        value = getattr(section, key)
        if value <= 0:
            raise ConfigError(f"{name}.{key} must be > 0; got {value}")


def choice(section: Any, name: str, key: str, choices: tuple[str, ...]) -> None:
    value = getattr(section, key)
    if value not in choices:
        raise ConfigError(f"{name}.{key} must be one of {list(choices)}; got {value!r}")


def step_window(name: str, spec: str) -> tuple[int, int] | None:
    """``"A-B"`` (or ``"A"``) as the steps (A, B), or None for ``""``; ConfigError saying what to write otherwise."""
    if not spec:
        return None
    first, _, last = spec.partition("-")
    try:
        window = int(first), int(last or first)
    except ValueError:
        raise ConfigError(f"{name} takes the steps as FIRST-LAST, e.g. 30-32; got {spec!r}") from None
    if not 1 <= window[0] <= window[1]:
        raise ConfigError(f"{name} takes the steps as FIRST-LAST with 1 <= FIRST <= LAST; got {spec!r}")
    return window
