"""Execute every analysis notebook headless (nbclient) against results/, so that they never rot; the
executed copies go to results/notebooks/.

    python -m analysis.run_notebooks
"""

from __future__ import annotations

import sys
from pathlib import Path

import nbformat
from nbclient import NotebookClient

from mecefo.errors import guarded
from mecefo.results import RESULTS

HERE = Path(__file__).resolve().parent


def execute(path: Path, timeout: int = 600) -> nbformat.NotebookNode:
    nb = nbformat.read(path, as_version=4)
    NotebookClient(nb, timeout=timeout, kernel_name="python3", resources={"metadata": {"path": str(HERE)}}).execute()
    return nb


def main() -> int:
    (RESULTS / "notebooks").mkdir(parents=True, exist_ok=True)
    for path in sorted(HERE.glob("*.ipynb")):
        nbformat.write(execute(path), RESULTS / "notebooks" / path.name)
        print(f"executed {path.name} -> {RESULTS / 'notebooks' / path.name}")
    return 0


if __name__ == "__main__":
    sys.exit(guarded(main))
