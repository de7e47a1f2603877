"""A worker that plants, in its own torchrun log folder, what would make a root agent read
files its user may not: links to a root-only file and folder where the agent looks for
workers' output.

    plant_links.py SECRET_FILE SECRET_DIR

It makes, beside its own worker folder (`attempt_<n>/<local rank>`, the folder of
TORCHELASTIC_ERROR_FILE), a worker folder `7` whose `stdout.log` is a link to SECRET_FILE,
a worker folder `8` that is a link to SECRET_DIR (which holds a `stdout.log`), and the next
restart's folder `attempt_<n+1>/0` whose `stdout.log` is a link to SECRET_FILE; then prints
`planted` and exits 0.
"""

import os
import sys
from pathlib import Path


def main() -> None:
    secret_file, secret_dir = sys.argv[1:3]
    mine = Path(os.environ["TORCHELASTIC_ERROR_FILE"]).parent
    attempt = mine.parent
    (attempt / "7").mkdir()
    (attempt / "7" / "stdout.log").symlink_to(secret_file)
    (attempt / "8").symlink_to(secret_dir)
    restart = int(attempt.name.removeprefix("attempt_").split(".")[0])
    later = attempt.parent / f"attempt_{restart + 1}" / "0"
    later.mkdir(parents=True)
    (later / "stdout.log").symlink_to(secret_file)
    print("planted", flush=True)


if __name__ == "__main__":
    main()
