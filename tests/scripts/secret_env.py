"""A worker that checks it got a secret env value, and prints it (to be masked by the agent).

    python secret_env.py NAME EXPECTED_FILE

Exits 0 if $NAME holds what EXPECTED_FILE holds (the test writes the file; the value is not
on the command line, which the control plane stores), 3 otherwise.
"""

import os
import sys
from pathlib import Path

name, expected = sys.argv[1], Path(sys.argv[2]).read_text()
got = os.environ.get(name)
print(f"the secret is {got} (rank {os.environ['RANK']})", flush=True)
sys.exit(0 if got == expected else 3)
