"""A job's shortest script whose nodes finish apart: rank 0 returns LATE seconds
after the others, as a rank 0 that writes the final model does. Standard library only, so a
run costs the test little more than torchrun's own start and exit.

    python finish_apart.py LATE
"""

import os
import sys
import time

if os.environ["RANK"] == "0":
    time.sleep(float(sys.argv[1]))
print(f"rank {os.environ['RANK']} of {os.environ['WORLD_SIZE']} done", flush=True)
