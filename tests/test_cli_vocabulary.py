"""One vocabulary across kvlab's commands (kvlab/vocabulary.py): every verb's parser, read from the
CLI's own dispatch table, lists none of the retired spellings, gives every option a help text, and
`kvlab --help` names every verb and every action a verb dispatches on."""

from __future__ import annotations

import argparse
import importlib

import pytest

from kvlab import cli
from kvlab.vocabulary import RETIRED


class Captured(Exception):
    def __init__(self, parser: argparse.ArgumentParser) -> None:
        self.parser = parser


def _capture(monkeypatch: pytest.MonkeyPatch, verb: str, argv: list[str]) -> argparse.ArgumentParser | None:
    """The parser `kvlab VERB ARGV...` builds: caught at its first parse, before the command does anything."""
    def caught(self: argparse.ArgumentParser, *a: object, **k: object) -> None:
        raise Captured(self)

    module = importlib.import_module(cli.COMMANDS[verb][0])
    with monkeypatch.context() as m:
        m.setattr(argparse.ArgumentParser, "parse_known_args", caught)
        try:
            module.main([verb, *argv] if getattr(module, "MULTI_COMMAND", False) else argv)
        except Captured as c:
            return c.parser
    return None


def _parsers(monkeypatch: pytest.MonkeyPatch, verb: str) -> list[argparse.ArgumentParser]:
    """The verb's parser and its sub-commands' (argparse sub-parsers, or a dispatch table such as engine's)."""
    module = importlib.import_module(cli.COMMANDS[verb][0])
    tops = [p for sub in getattr(module, "BACKENDS", {None: None}) if (p := _capture(
        monkeypatch, verb, [sub] if sub else [])) is not None]
    out = []
    while tops:
        p = tops.pop()
        out.append(p)
        for action in p._actions:
            if isinstance(action, argparse._SubParsersAction):
                tops += list(action.choices.values())
    return out


def _visible(p: argparse.ArgumentParser) -> list[argparse.Action]:
    return [a for a in p._actions if a.help is not argparse.SUPPRESS and not isinstance(a, argparse._HelpAction)]


VERBS = list(cli.COMMANDS)


@pytest.mark.parametrize("verb", VERBS)
def test_one_vocabulary(monkeypatch, verb):
    parsers = _parsers(monkeypatch, verb)
    assert parsers, f"kvlab {verb}: no argparse parser found"
    for p in parsers:
        for action in _visible(p):
            listed = set(action.option_strings)
            assert not listed & set(RETIRED), f"{p.prog}: {sorted(listed & set(RETIRED))} is a retired spelling"
            if isinstance(action, argparse._SubParsersAction):
                continue
            assert action.help, f"{p.prog} {'/'.join(action.option_strings) or action.dest}: no help text"


def test_old_spellings_still_parse(monkeypatch):
    compare = _capture(monkeypatch, "compare", [])
    assert compare is not None and compare.parse_args(["--routers", "prefix"]).policies == "prefix"
    assert compare.parse_args([]).policies is None
    bench = _capture(monkeypatch, "bench", [])
    assert bench is not None
    old = bench.parse_args(["--params", '{"groups": 2}', "--out", "d"])
    assert (old.workload_params, old.run_dir) == ('{"groups": 2}', "d")
    assert "--params" not in bench.format_help()


def test_help_names_every_verb_and_action(monkeypatch, capsys):
    assert cli.main(["--help"]) == 0
    usage = capsys.readouterr().out
    for verb in cli.COMMANDS:
        assert f"  {verb} " in usage, f"kvlab --help: no {verb}"
        line = next(x for x in usage.splitlines() if x.startswith(f"  {verb} "))
        module = importlib.import_module(cli.COMMANDS[verb][0])
        actions = list(getattr(module, "BACKENDS", {}))
        if (p := _capture(monkeypatch, verb, [])) is not None:
            for a in p._actions:
                if isinstance(a, argparse._SubParsersAction) or (
                        not a.option_strings and a.choices and a.nargs is None):
                    actions += list(a.choices)
        for action in actions:
            assert action in line, f"kvlab --help: {verb}'s line names no {action!r}"


def test_status_and_down_say_what_they_do(monkeypatch):
    helps = {v: p.description for v in ("up", "status", "down") if (p := _capture(monkeypatch, v, []))}
    assert len(set(helps.values())) == 3, helps
