"""One way to replace a vLLM symbol, and the list of every symbol replaced.

``@wrap(Owner, "name")`` turns ``def replacement(original, *args, **kwargs)`` into
``Owner.name``; ``PATCHED`` names each replaced symbol (docs/integration.md lists them all, a
test checks it).
"""

from __future__ import annotations

import functools
from collections.abc import Callable

PATCHED: list[str] = []


def _qualname(owner, name: str) -> str:
    if isinstance(owner, type):
        return f"{owner.__module__}.{owner.__qualname__}.{name}"
    return f"{owner.__name__}.{name}"  # a module


def wrap(owner, name: str) -> Callable:
    """Decorator: ``owner.name`` becomes ``replacement(original, *args, **kwargs)``."""

    def decorate(replacement: Callable) -> Callable:
        original = getattr(owner, name)

        @functools.wraps(original)
        def wrapper(*args, **kwargs):
            return replacement(original, *args, **kwargs)

        setattr(owner, name, wrapper)
        PATCHED.append(_qualname(owner, name))
        return replacement

    return decorate


def wrap_property(owner, name: str) -> Callable:
    """Decorator: the property ``owner.name`` becomes ``replacement(original_getter, self)``."""

    def decorate(replacement: Callable) -> Callable:
        getter = getattr(owner, name).fget
        setattr(
            owner, name, property(functools.wraps(getter)(lambda self: replacement(getter, self)))
        )
        PATCHED.append(_qualname(owner, name))
        return replacement

    return decorate


def replace(owner, name: str, value) -> None:
    """``owner.name = value`` (a module attribute or class), recorded in ``PATCHED``."""
    setattr(owner, name, value)
    PATCHED.append(f"{owner.__name__}.{name}")
