"""Prints, per worker, its torchrun place and SLURM's names for it:
`SLURM RANK SLURM_PROCID LOCAL_RANK SLURM_LOCALID WORLD_SIZE SLURM_NTASKS`."""

import os

names = ("RANK", "SLURM_PROCID", "LOCAL_RANK", "SLURM_LOCALID", "WORLD_SIZE", "SLURM_NTASKS")
print("SLURM", *(os.environ.get(n, "-") for n in names), flush=True)
