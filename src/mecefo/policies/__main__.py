"""python -m mecefo.policies: print the registered policies as a table (docs/training.md holds the same table,
written there by python -m paper_figures.readme)."""

import sys

from . import table


def main() -> int:
    print(table(), end="")
    return 0


if __name__ == "__main__":
    sys.exit(main())
