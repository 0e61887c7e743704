"""python -m mecefo.policies [--readme]: print the registered policies as a table, or write it into the
README between its policies markers."""

import re
import sys

from ..errors import UsageError, guarded
from ..records import atomic_write_text
from ..results import ROOT
from . import table

BEGIN, END = "<!-- policies:begin -->", "<!-- policies:end -->"


def main() -> int:
    text = table()
    if "--readme" not in sys.argv[1:]:
        print(text, end="")
        return 0
    readme = ROOT / "README.md"
    old = readme.read_text()
    if BEGIN not in old or END not in old:
        raise UsageError(f"{readme} has no {BEGIN} ... {END} section")
    new = re.sub(re.escape(BEGIN) + ".*?" + re.escape(END), lambda _: f"{BEGIN}\n{text}{END}", old, flags=re.S)
    if new != old:
        atomic_write_text(readme, new)
    print(f"policy table ({text.count(chr(10)) - 2} policies) -> {readme}")
    return 0


if __name__ == "__main__":
    sys.exit(guarded(main))
