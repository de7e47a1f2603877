"""A worker that prints what must not leave the node unmasked: its job token, and every line of
a multi-line secret env value (a PEM key in $KEY). The agent masks both before it ships a line.

    python prints_secrets.py
"""

import os

print(f"my token is {os.environ['FTRAIN_JOB_TOKEN']} (rank {os.environ['RANK']})", flush=True)
print(os.environ["KEY"], flush=True)
