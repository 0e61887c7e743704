"""The three parts behind mecefo.train.Run (membership, step engine, run files) are used exactly as their written
contracts say: every name Run (and torchft's replica) touches on a part is in that part's contract, and no caller
writes a part's attributes."""

import ast
import re

import pytest

from mecefo import engine, membership, runfiles
from tests.conftest import ROOT

CALLERS = [ROOT / "src" / "mecefo" / "train.py", ROOT / "src" / "mecefo" / "ft.py"]
PARTS = {"membership": membership, "engine": engine, "files": runfiles}


def _touched():
    """part -> {name: where} for every attribute read or written on a part (x.membership.NAME, membership.NAME, ...)."""
    found = {part: {} for part in PARTS}
    writes = []
    for path in CALLERS:
        tree = ast.parse(path.read_text())
        for node in ast.walk(tree):
            if isinstance(node, ast.Attribute):
                v = node.value
                name = v.id if isinstance(v, ast.Name) else v.attr if isinstance(v, ast.Attribute) else None
                if name in PARTS:
                    found[name].setdefault(node.attr, f"{path.name}:{node.lineno}")
                    if isinstance(node.ctx, ast.Store):
                        writes.append(f"{path.name}:{node.lineno}: {name}.{node.attr} =")
    return found, writes


@pytest.mark.parametrize("part", sorted(PARTS))
def test_every_name_the_run_uses_on_a_part_is_in_its_contract(part):
    found, _ = _touched()
    doc = PARTS[part].__doc__
    missing = {name: where for name, where in found[part].items() if not re.search(rf"\b{name}\b", doc)}
    assert found[part] and missing == {}


def test_no_caller_writes_a_parts_attributes():
    assert _touched()[1] == []
