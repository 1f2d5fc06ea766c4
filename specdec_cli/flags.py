"""What every command's flags share: the help formatter, defaults read from the config dataclasses
(one source for a default), and the error for a mistake in the command line. No torch here."""

from __future__ import annotations

import argparse
import dataclasses
from typing import Any


class UsageError(Exception):
    """A mistake in the command line or in what it points at (an empty prompt, a port in use, a
    service that cannot start): `specdec` prints the message as one line and exits with status 2;
    with --debug it shows the traceback."""


class HelpFormatter(argparse.ArgumentDefaultsHelpFormatter):
    """Appends '(default: X)' to a flag's help unless the help already says its default or there
    is none to show (None, False, an empty list)."""

    def _get_help_string(self, action: argparse.Action) -> str:
        text = action.help or ""
        if "default" in text or action.default in (None, False, [], argparse.SUPPRESS):
            return text
        return super()._get_help_string(action)


def default_of(config_class: type, name: str) -> Any:
    """The default of field `name` of a config dataclass, for a flag that sets it."""
    for field in dataclasses.fields(config_class):
        if field.name == name:
            if field.default is not dataclasses.MISSING:
                return field.default
            if field.default_factory is not dataclasses.MISSING:
                return field.default_factory()
            raise ValueError(f"{config_class.__name__}.{name} has no default")
    raise ValueError(f"{config_class.__name__} has no field {name!r}")
