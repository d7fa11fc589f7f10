"""Optional extras: a command that needs one checks for it first and, where it is missing,
says how to install it (one line, exit code 2) instead of failing later with a traceback."""

from __future__ import annotations

import importlib

# extra -> the modules it brings that the commands import (pyproject.toml declares them).
EXTRAS: dict[str, tuple[str, ...]] = {
    "engine": ("torch", "transformers"),
    "plots": ("matplotlib",),
}


class MissingExtra(Exception):
    """An optional extra a command needs is not installed; the message says how to get it."""


def require_extra(extra: str, purpose: str) -> None:
    """Import the modules of `extra`; `purpose` names what needs them in the message.

    Raises:
        MissingExtra: one of them does not import.
    """
    for module in EXTRAS[extra]:
        try:
            importlib.import_module(module)
        except ImportError as exc:
            raise MissingExtra(
                f"{purpose} needs the '{extra}' extra ({exc}): pip install 'prfaas[{extra}]'"
            ) from None
