"""tools/mutants.py stays in sync with the sources: every mutant's anchor occurs exactly once in the
current file and every test it names exists. Fast (no pytest subprocess): the mutation run itself is
`python tools/mutants.py` (CI runs it after the test suite)."""

from __future__ import annotations

import importlib.util
import re
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent


def load_tool():
    spec = importlib.util.spec_from_file_location("fa4_mutants_tool", ROOT / "tools" / "mutants.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up while the class is created
    spec.loader.exec_module(module)
    return module


mutants = load_tool()


def test_every_anchor_is_in_the_sources_exactly_once():
    assert mutants.anchor_problems() == [], "\n".join(mutants.anchor_problems())


def test_names_are_unique():
    names = [m.name for m in mutants.MUTANTS]
    assert len(names) == len(set(names))


@pytest.mark.parametrize("mutant", mutants.MUTANTS, ids=lambda m: m.name)
def test_named_tests_exist(mutant):
    files = [a for a in mutant.tests if a.startswith("tests/")]
    assert files, f"{mutant.name}: names no test file"
    for arg in files:
        path, _, node = arg.partition("::")
        text = (ROOT / path).read_text()
        if node:
            function = re.sub(r"\[.*\]$", "", node)
            assert re.search(rf"^def {re.escape(function)}\(", text, re.M), f"{mutant.name}: no {function} in {path}"
    if "-k" in mutant.tests:  # each plain word of the -k expression names something in those files
        expression = mutant.tests[mutant.tests.index("-k") + 1]
        text = "".join((ROOT / a.partition("::")[0]).read_text() for a in files)
        for word in re.findall(r"\w+", expression):
            if word not in ("and", "or", "not"):
                assert word in text, f"{mutant.name}: -k {expression!r}: {word!r} appears in none of {files}"
