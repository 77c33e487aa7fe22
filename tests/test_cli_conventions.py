"""What operators expect of every command line: a version on -V and --version, help on -h as on --help."""

from __future__ import annotations

from importlib.metadata import version

import pytest

from conftest import run_cli
from flatshare_ops.common.protocol import GENERATION, VERSION


@pytest.mark.parametrize("program, code", [("flatshare", 0), ("flatshare-node", 0), ("serving-check", 3)])
def test_each_program_says_its_version_with_both_spellings(program, code):
    for spelling in ("--version", "-V"):
        done = run_cli(spelling, program=program)
        assert done.returncode == code, done  # serving-check: UNKNOWN, as the monitoring-plugins guidelines ask
        words = done.stdout.replace("(", " ").replace(")", " ").replace(",", " ").split()
        assert words[0] == program and version("flatshare-ops") in words, done.stdout
        if program != "serving-check":  # which bundles this side runs
            assert str(VERSION) == words[words.index("protocol") + 1]
            assert str(GENERATION) == words[words.index("generation") + 1]


def test_minus_h_is_help_as_much_as_double_dash_help():
    for args in (["-h"], ["release", "-h"], ["sandbox", "up", "-h"]):
        short, long = run_cli(*args), run_cli(*args[:-1], "--help")
        assert short.returncode == 0 and short.stdout == long.stdout and "Usage: flatshare" in short.stdout
