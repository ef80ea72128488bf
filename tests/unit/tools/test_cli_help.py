"""Every ``vllm-mtp`` command's ``--help``: every option explained, defaults shown, an example, no
reStructuredText markup; and the README's command table names only what the parsers accept.

No engine starts: each command's ``main`` runs until its parser parses, and is stopped there with
the parser in hand.
"""

from __future__ import annotations

import argparse
import re
from unittest import mock

import pytest

from support import paths
from vllm_mtp_plugin.tools import cli
from vllm_mtp_plugin.tools.cli_help import STATES_DEFAULT, HelpFormatter
from vllm_mtp_plugin.tools.tune import check as tune_check

README = paths.REPO / "README.md"
TUNE_CHECK = "python -m vllm_mtp_plugin.tools.tune.check"
COMMANDS = sorted(cli.COMMANDS)


class Parsed(Exception):
    def __init__(self, parser: argparse.ArgumentParser):
        super().__init__(parser.prog)
        self.parser = parser


def _stop(parser, *args, **kwargs):
    raise Parsed(parser)


def parser_of(command: str) -> argparse.ArgumentParser:
    """The parser ``command`` builds (serve: the options it adds to vllm serve's)."""
    with mock.patch.object(argparse.ArgumentParser, "parse_known_args", _stop), \
            mock.patch.object(argparse.ArgumentParser, "parse_args", _stop):
        try:
            tune_check.main([]) if command == TUNE_CHECK else cli.main([command])
        except Parsed as parsed:
            return parsed.parser
    raise AssertionError(f"{command} parsed no arguments")


PARSERS = [*COMMANDS, TUNE_CHECK]


def own_actions(parser: argparse.ArgumentParser) -> list[argparse.Action]:
    return [a for a in parser._actions if not isinstance(a, argparse._HelpAction)]


def action_help(parser: argparse.ArgumentParser, action: argparse.Action) -> str:
    """One option's entry as ``--help`` prints it."""
    formatter = parser._get_formatter()
    formatter.add_argument(action)
    return " ".join(formatter.format_help().split())


def test_every_command_is_covered():
    assert {"serve", "demo", "build-tiny", "inspect", "graft", "train", "bench", "tune", "doctor",
            "reload"} <= set(COMMANDS)


@pytest.mark.parametrize("command", PARSERS)
def test_every_option_is_explained_with_its_default(command):
    parser = parser_of(command)
    assert issubclass(parser.formatter_class, HelpFormatter)
    unexplained = [a.dest for a in own_actions(parser) if not (a.help or "").strip()]
    assert unexplained == []
    for action in own_actions(parser):
        entry = action_help(parser, action)
        if action.option_strings and action.default not in (None, False, argparse.SUPPRESS):
            assert STATES_DEFAULT.search(entry), entry
    text = parser.format_help()
    assert "default: None" not in text and "%(" not in text


@pytest.mark.parametrize("command", PARSERS)
def test_help_has_an_example_and_no_markup(command):
    parser = parser_of(command)
    text = parser.format_help()
    assert "``" not in text
    lines = text.split("examples:\n", 1)[-1].splitlines() if "examples:\n" in text else []
    invocation = TUNE_CHECK if command == TUNE_CHECK else f"vllm-mtp {command}"
    assert any(invocation in line for line in lines), f"{command}: no example in --help"


def test_the_formatter_shows_lists_as_typed_and_keeps_examples():
    parser = argparse.ArgumentParser(prog="p", formatter_class=HelpFormatter,
                                     description="Uses ``x``.", epilog="examples:\n  p -k 1\n  p")
    parser.add_argument("-k", nargs="+", type=int, default=[0, 1], help="k values")
    parser.add_argument("--out", default=None, help="where (default: stdout)")
    text = parser.format_help()
    assert "(default: 0 1)" in text and "default: None" not in text and "``" not in text
    assert "examples:\n  p -k 1\n  p" in text


def readme_commands() -> list[tuple[str, str]]:
    """(command, its code span) for every ``vllm-mtp`` span in the README's command table."""
    found = []
    for line in README.read_text().splitlines():
        if not line.startswith("| `vllm-mtp "):
            continue
        first_cell = re.split(r"(?<!\\)\|", line)[1]
        for span in re.findall(r"`([^`]+)`", first_cell):
            words = span.replace("\\|", "|").split()
            if words[0] == "vllm-mtp":
                found.append((words[1], " ".join(words[2:])))
    return found


def test_the_readme_table_names_every_command():
    assert {command for command, _ in readme_commands()} == set(COMMANDS)


@pytest.mark.parametrize("command, span", readme_commands())
def test_every_option_in_the_readme_table_exists(command, span):
    parser = parser_of(command)
    options = {s: a for a in parser._actions for s in a.option_strings}
    words = span.replace("[", " ").replace("]", " ").split()
    for i, word in enumerate(words):
        if not re.fullmatch(r"--?[a-z][\w-]*", word):
            continue
        assert word in options, f"vllm-mtp {command} has no option {word}"
        action = options[word]
        value = words[i + 1] if i + 1 < len(words) else ""
        if action.metavar and re.fullmatch(r"[A-Z_]+", value):
            assert value == action.metavar, f"{word} {value}: the parser names it {action.metavar}"
        if action.choices and re.fullmatch(r"[a-z][\w|-]*", value):
            assert set(value.split("|")) <= set(action.choices), f"{word} {value}"
    modes = next((a.choices for a in parser._actions if not a.option_strings and a.choices), None)
    if modes and words and not words[0].startswith("-"):
        assert set(words[0].split("|")) <= set(modes), f"vllm-mtp {command} {words[0]}"


def test_the_demo_refuses_a_negative_warmup(capsys):
    from vllm_mtp_plugin.tools import demo

    assert demo.parse_args([]).warmup == 1  # one unmeasured pass per server by default
    with pytest.raises(SystemExit) as exited:
        demo.parse_args(["--warmup", "-1"])
    assert exited.value.code == 2
    assert "--warmup -1: give 0 or more passes" in capsys.readouterr().err
