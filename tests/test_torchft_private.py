"""torchft's internals are used in one module (mecefo.torchft_private), each name listed with the torchft version it
was read from; an upgrade that moves one fails here, by name. No module of ours imports another's private names."""

import re

from mecefo import torchft_private
from tests.conftest import ROOT

SRC = ROOT / "src" / "mecefo"


def test_every_private_name_we_use_is_where_torchft_defined_it():
    import importlib.metadata

    installed = importlib.metadata.version("torchft")
    moved = torchft_private.problems()
    assert not moved, (f"torchft {installed} moved {moved}, read from torchft {torchft_private.READ_FROM} "
                       "(mecefo.torchft_private.PRIVATE): mend the functions that use them")


def test_no_other_module_reaches_into_torchft():
    attributes = {name.split(".")[-1] for name in torchft_private.PRIVATE}
    pattern = re.compile(r"(?<!self)\.(" + "|".join(sorted(attributes)) + r")\b")
    offenders = [f"{path.name}:{i}: {line.strip()}" for path in sorted(SRC.rglob("*.py")) if path.name != "torchft_private.py"
                 for i, line in enumerate(path.read_text().splitlines(), 1) if pattern.search(line)]
    assert offenders == []


def test_no_module_imports_another_modules_private_names():
    ours = [p for d in ("src/mecefo", "experiments", "analysis", "paper_figures") for p in sorted((ROOT / d).rglob("*.py"))]
    pattern = re.compile(r"^\s*from\s+(\.[\w.]*|mecefo[\w.]*|experiments[\w.]*|analysis[\w.]*)\s+import\s+(.*)$")
    offenders = []
    for path in ours:
        for i, line in enumerate(path.read_text().splitlines(), 1):
            m = pattern.match(line)
            if m and any(name.strip().split(" as ")[0].startswith("_") and not name.strip().startswith("__")
                         for name in m.group(2).strip("()").split(",")):
                offenders.append(f"{path.relative_to(ROOT)}:{i}: {line.strip()}")
    assert offenders == []
