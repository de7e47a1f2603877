"""A plain script (no runtime, no torch) that makes `--steps` steps of `--step-time` s and
exits 0; on SIGTERM it says so, then goes on "saving" (a line every 0.25 s with the seconds
since the SIGTERM) until it is killed: the lines show how long a grace it was given."""

import argparse
import signal
import time

p = argparse.ArgumentParser()
p.add_argument("--steps", type=int, default=20)
p.add_argument("--step-time", type=float, default=0.1)
args = p.parse_args()
termed: list[float] = []
signal.signal(signal.SIGTERM, lambda *_: termed.append(time.monotonic()))
for step in range(1, args.steps + 1):
    if termed:
        break
    time.sleep(args.step_time)
    print(f"step {step}", flush=True)
if termed:
    print(f"SIGTERM at step {step}: saving", flush=True)
    while True:
        time.sleep(0.25)
        print(f"saving {time.monotonic() - termed[0]:.2f} s after SIGTERM", flush=True)
