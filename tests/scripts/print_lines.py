"""Print many long lines, each flushed on its own, as fast as it can, then exit
(tests/integration/test_logs.py): `<rank> <i> ` followed by filler up to --chars characters.

`print(..., flush=True)`, as scripts do, with no pause: under torchrun (PYTHONUNBUFFERED) each
line is two writes, its text and then its newline, and the worker's file grows while whoever
follows it reads, so a reader that ships a line it caught half-written splits it.
"""

import argparse
import os
import sys


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--lines", type=int, default=20000)
    ap.add_argument("--chars", type=int, default=200)
    args = ap.parse_args()
    rank = os.environ.get("RANK", "0")
    for i in range(args.lines):
        head = f"{rank} {i} "
        print(head + "x" * max(0, args.chars - len(head)), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
