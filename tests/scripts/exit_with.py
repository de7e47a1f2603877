"""A worker that prints a line and exits with the code it is given (CLI exit-code tests)."""

import os
import sys

print(f"hello from rank {os.environ.get('RANK')}", flush=True)
sys.exit(int(sys.argv[1]))
