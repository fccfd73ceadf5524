"""``nodeagent`` sub-commands; each module exposes ``register(subparsers)``."""

from __future__ import annotations

import argparse


class KeepLinesFormatter(argparse.HelpFormatter):
    """argparse's formatter, except that a text with line breaks of its own (a table) is kept as it is.

    One-paragraph descriptions are wrapped to the terminal as usual; the exit status table of the
    epilogs (:func:`agent.errors.exit_status_help`) keeps its columns.
    """

    def _fill_text(self, text: str, width: int, indent: str) -> str:
        if "\n" in text:
            return "".join(indent + line for line in text.splitlines(keepends=True))
        return super()._fill_text(text, width, indent)
