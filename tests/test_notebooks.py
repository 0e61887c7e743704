"""Every analysis notebook runs headless on the results it reads. CI runs the tests before
`run_all.sh --quick`, which executes the notebooks itself (analysis.run_notebooks); here they run when the
results exist (after any run_all) and are skipped otherwise."""

import pytest

from analysis.run_notebooks import HERE, execute
from experiments.common import RESULTS

NEEDS = {"bias_variance.ipynb": "analysis/bias_variance", "grad_error.ipynb": "analysis/grad_error",
         "rate.ipynb": "analysis/rate", "loss_curves.ipynb": "sweep/index"}


def test_every_notebook_is_covered():
    assert {p.name for p in HERE.glob("*.ipynb")} == set(NEEDS)


@pytest.mark.parametrize("name", sorted(NEEDS))
def test_notebook_executes(name):
    if not any((RESULTS / f"{NEEDS[name]}-{p}.json").exists() for p in ("quick", "default")):
        pytest.skip(f"no {NEEDS[name]}-*.json yet (run_all.sh executes the notebooks after producing it)")
    nb = execute(HERE / name, timeout=300)
    assert all(out.get("output_type") != "error" for cell in nb.cells for out in cell.get("outputs", []))
