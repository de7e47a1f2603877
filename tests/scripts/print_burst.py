"""Print a burst of long lines at once and exit (tests/integration/test_logs.py).

Each line is `burst <i> ` followed by filler up to --chars characters; all of them go out in
one write, as a script that dumps a table or a traceback storm would.
"""

import argparse
import sys


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--lines", type=int, default=3000)
    ap.add_argument("--chars", type=int, default=1000)
    args = ap.parse_args()
    out = []
    for i in range(args.lines):
        head = f"burst {i} "
        out.append(head + "x" * max(0, args.chars - len(head)) + "\n")
    sys.stdout.write("".join(out))
    sys.stdout.flush()
    return 0


if __name__ == "__main__":
    sys.exit(main())
