"""python -m paper_figures.readme [--quick]: the one writer of the README and the docs/ pages' generated blocks.

A page marks a block with `<!-- name:begin -->` ... `<!-- name:end -->`. The figure and table scripts write each
block's text to paper_figures/out/blocks-<profile>/<name>.md; this module splices them in:

- the default profile's blocks go into README.md and docs/*.md in place (what is committed);
- the quick profile's go into copies under paper_figures/out/pages-quick/ (CI's numbers, a preview: the committed
  pages keep the default profile's);
- the tables generated from the registries (the policies, the backends) and the blocks true under any profile
  (paper_figures/out/blocks-any/: the profiles' times) go into the committed pages under either profile.

A block file whose name no page marks is an error (exit 2); a marked block with no file this run keeps its text.
Links are written from the repository root (`docs/figures/x.png`) and made relative to the page."""

from __future__ import annotations

import re
import sys
from pathlib import Path

from mecefo.errors import UsageError, guarded
from mecefo.records import atomic_write_text
from mecefo.results import FIGURES as OUT
from mecefo.results import ROOT


def pages() -> list[Path]:
    return [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]


def _marker(name: str) -> re.Pattern:
    return re.compile(rf"(<!-- {re.escape(name)}:begin -->\n).*?(\n?<!-- {re.escape(name)}:end -->)", re.S)


def block_text(name: str) -> str:
    """The committed text of block `name`, wherever a page marks it (for the tests that keep it true)."""
    for page in pages():
        found = _marker(name).search(page.read_text())
        if found:
            return found.group(0).split("-->\n", 1)[1].rsplit("<!--", 1)[0]
    raise KeyError(f"no page marks a block {name!r}")


def registry_blocks() -> dict[str, str]:
    from mecefo.cluster import backends_table
    from mecefo.policies import table

    return {"policies": table(), "backends": backends_table()}


def relative(text: str, page: Path) -> str:
    """Links from the repository root (`docs/figures/x.png`, `docs/page.md#a`) made relative to a docs/ page."""
    return text if page.parent == ROOT else text.replace("](docs/", "](")


def splice(blocks: dict[str, str], into: Path | None) -> list[str]:
    """Each block into the page that marks it; pages written to `into` (a folder) or, if None, in place. A block
    no page marks is an error before any page is written."""
    placed, texts = set(), {}
    for page in pages():
        new = page.read_text()
        for name, text in blocks.items():
            pattern = _marker(name)
            if pattern.search(new):
                body = relative(text.rstrip("\n"), page)
                new = pattern.sub(lambda m, body=body: m.group(1) + body + "\n" + m.group(2).lstrip("\n"), new)
                placed.add(name)
        texts[page] = new
    missing = sorted(set(blocks) - placed)
    if missing:
        raise UsageError(f"no page marks the block(s) {', '.join(missing)} (add <!-- name:begin --> ... <!-- name:end -->)")
    written = []
    for page, new in texts.items():
        target = page if into is None else into / page.relative_to(ROOT)
        if into is not None or new != page.read_text():
            target.parent.mkdir(parents=True, exist_ok=True)
            atomic_write_text(target, new)
            written.append(str(target.relative_to(ROOT)))
    return written


def read(folder: Path) -> dict[str, str]:
    return {p.stem: p.read_text() for p in sorted(folder.glob("*.md"))}


def main(argv: list[str]) -> int:
    if argv not in ([], ["--quick"]):
        raise UsageError("usage: python -m paper_figures.readme [--quick]")
    profile = "quick" if argv else "default"
    results = read(OUT / f"blocks-{profile}")
    written = splice(registry_blocks() | read(OUT / "blocks-any"), None)
    written += splice(results, OUT / "pages-quick" if profile == "quick" else None)
    print(f"{len(results)} blocks of the {profile} profile and the registry's and any profile's -> "
          f"{', '.join(sorted(set(written))) or 'no page changed'}")
    return 0


if __name__ == "__main__":
    sys.exit(guarded(lambda: main(sys.argv[1:])))
