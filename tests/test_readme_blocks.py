"""paper_figures.readme (the one writer of the pages' generated blocks) and paper_figures.profile (run_all.sh's
step times), on pages in a temporary folder."""

import pytest

from mecefo.errors import UsageError
from paper_figures import profile, readme

PAGE = "# Title\n\nintro\n\n<!-- headline:begin -->\nold table\n<!-- headline:end -->\n\ntail [x](docs/a.md)\n"
DOC = "# Doc\n\n<!-- answers:begin -->\n<!-- answers:end -->\n"


@pytest.fixture
def site(tmp_path, monkeypatch):
    (tmp_path / "docs").mkdir()
    (tmp_path / "README.md").write_text(PAGE)
    (tmp_path / "docs" / "results.md").write_text(DOC)
    monkeypatch.setattr(readme, "ROOT", tmp_path)
    return tmp_path


def test_blocks_are_spliced_in_place_with_links_relative_to_the_page(site):
    blocks = {"headline": "| a | b |\n| see [p](docs/results.md#q) |\n", "answers": "see ![f](docs/figures/f.png)\n"}
    written = readme.splice(blocks, None)
    assert sorted(written) == ["README.md", "docs/results.md"]
    text = (site / "README.md").read_text()
    assert "old table" not in text and "| see [p](docs/results.md#q) |\n<!-- headline:end -->" in text
    assert text.startswith("# Title\n\nintro\n") and text.endswith("tail [x](docs/a.md)\n")  # the rest untouched
    assert "see ![f](figures/f.png)\n<!-- answers:end -->" in (site / "docs" / "results.md").read_text()
    assert readme.splice(blocks, None) == []  # idempotent: a second pass changes nothing
    assert readme.block_text("headline") == "| a | b |\n| see [p](docs/results.md#q) |\n"


def test_an_unmarked_block_is_refused_before_any_page_is_written(site):
    with pytest.raises(UsageError, match="nowhere"):
        readme.splice({"headline": "new", "nowhere": "x"}, None)
    assert (site / "README.md").read_text() == PAGE


def test_the_quick_profile_writes_copies_and_leaves_the_committed_pages(site):
    written = readme.splice({"headline": "quick numbers"}, site / "out")
    assert (site / "README.md").read_text() == PAGE
    assert "quick numbers" in (site / "out" / "README.md").read_text()
    assert "out/docs/results.md" in written  # every page is copied, marked or not


def test_bad_arguments_are_refused():
    with pytest.raises(UsageError):
        readme.main(["--default"])
    with pytest.raises(UsageError):
        profile.main(["--quick"])


def row(invocation, command, seconds, fresh=True):
    return {"invocation": invocation, "commit": "abc", "fresh": fresh, "cores": "2", "command": command,
            "seconds": seconds}


def test_the_profile_table_is_the_latest_invocation_and_says_whether_it_started_empty():
    rows = [row("2026-01-01T00:00:00Z", "a", 600.0), row("2026-01-02T00:00:00Z", "a", 60.0, fresh=False),
            row("2026-01-02T00:00:00Z", "b", 180.0, fresh=False)]
    run = profile.latest(rows)
    assert [r["command"] for r in run] == ["a", "b"]
    text = profile.table("quick", run)
    assert "`bash run_all.sh --quick`: 4.0 min" in text and "reusing results/" in text
    assert "| `a` | 1.0 min | 25% |" in text and "| **total** | **4.0 min** | |" in text


def test_a_profile_not_run_here_keeps_its_committed_line():
    committed = "- `bash run_all.sh`: 55.0 min (started X, commit `c`, 2 cores, from an empty results/)\n"
    runs = {"quick": [row("2026-01-01T00:00:00Z", "a", 300.0)]}
    lines = profile.summary(runs, committed).splitlines()
    assert lines[0].startswith("- `bash run_all.sh --quick`: 5.0 min") and "from an empty results/" in lines[0]
    assert lines[1] == committed.strip()
    assert "No profile" in profile.summary({}, "")


def test_figure_scripts_import_no_experiment_or_analysis_module():
    """paper_figures/ only draws: what it needs beside the numbers (orders, labels, tolerances) comes with the results,
    so a figure can never disagree with the experiment that decided it."""
    import ast

    from tests.conftest import ROOT

    offenders = []
    for path in sorted((ROOT / "paper_figures").glob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            names = ([a.name for a in node.names] if isinstance(node, ast.Import)
                     else [node.module or ""] if isinstance(node, ast.ImportFrom) and not node.level else [])
            offenders += [f"{path.name}: {n}" for n in names if n.split(".")[0] in ("experiments", "analysis")]
    assert offenders == []
