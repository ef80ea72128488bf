"""How every ``vllm-mtp`` command prints ``--help``: each option with its default, examples as
written, no reStructuredText markup.

The parsers' descriptions come from module docstrings, written for the code's readers with
``literal`` markup; the terminal gets them without it. An option whose default is ``None`` or
``False`` (left out: off, or a value found later) gets no "(default: None)": its help says what
leaving it out means.
"""

from __future__ import annotations

import argparse
import copy
import re
import textwrap

LITERAL = re.compile(r"``(.*?)``", re.S)
# A help text that says the default itself: "(default: ...)", "x (default)", "...; default x".
STATES_DEFAULT = re.compile(r"\(default\b|\bdefault:|;\s*default\b", re.I)


def plain(text: str) -> str:
    """``text`` without reStructuredText literal markup."""
    return LITERAL.sub(r"\1", text)


def shown(value) -> str:
    """A default as it is typed on the command line: a list as its items, space-separated."""
    if isinstance(value, (list, tuple)):
        return " ".join(map(str, value))
    return str(value)


class HelpFormatter(argparse.HelpFormatter):
    """argparse's formatter, with the default of every option that has one, indented paragraphs
    (examples) kept line by line, and no ``literal`` markup."""

    def _get_help_string(self, action: argparse.Action) -> str:
        text = action.help or ""
        if (any(action.default is unset for unset in (None, False, argparse.SUPPRESS))
                or STATES_DEFAULT.search(text)
                or not (action.option_strings or action.nargs in ("?", "*"))):
            return text
        return f"{text} (default: %(default)s)" if text else "default: %(default)s"

    def _expand_help(self, action: argparse.Action) -> str:
        if isinstance(action.default, (list, tuple)):
            action = copy.copy(action)
            action.default = shown(action.default)
        return plain(super()._expand_help(action))

    def _split_lines(self, text: str, width: int) -> list[str]:
        # Options and paths wrap whole: "--tensor-parallel-size", not "--tensor-" and "parallel-size".
        return textwrap.wrap(" ".join(text.split()), width, break_on_hyphens=False)

    def _fill_text(self, text: str, width: int, indent: str) -> str:
        paragraphs = []
        for paragraph in plain(text).strip("\n").split("\n\n"):
            lines = paragraph.split("\n")
            if all(line.startswith(" ") for line in lines[1:] or lines):
                paragraphs.append("\n".join(indent + line for line in lines))
            else:
                paragraphs.append(textwrap.fill(" ".join(paragraph.split()), width,
                                                initial_indent=indent, subsequent_indent=indent,
                                                break_on_hyphens=False))
        return "\n\n".join(paragraphs)


def examples(*lines: str) -> str:
    """An epilog of examples: ``command  # what it does`` per line."""
    return "examples:\n" + "\n".join(f"  {line}" for line in lines)
