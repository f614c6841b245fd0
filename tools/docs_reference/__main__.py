"""``python -m tools.docs_reference [--check]``: write the reference pages, or check them."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from tools.docs_reference import REFERENCE, ROOT, files, stale


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m tools.docs_reference", description=__doc__)
    parser.add_argument(
        "--check", action="store_true", help="Write nothing; exit 1 if a page is stale."
    )
    parser.add_argument(
        "--out", type=Path, default=REFERENCE, help="The folder (default: docs/reference)."
    )
    args = parser.parse_args(argv)
    made = files()
    changed = stale(made, args.out)
    where = args.out.relative_to(ROOT) if args.out.is_relative_to(ROOT) else args.out
    if args.check:
        for name in changed:
            print(f"{where}/{name} is stale: run `make docs`", file=sys.stderr)
        return 1 if changed else 0
    args.out.mkdir(parents=True, exist_ok=True)
    for name in changed:
        (args.out / name).write_text(made[name])
    print(f"{where}: {len(changed)} of {len(made)} files rewritten")
    return 0


if __name__ == "__main__":
    sys.exit(main())
