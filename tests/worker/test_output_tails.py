"""A failed group's last lines read from the ends of torchrun's output files (the agent's
reader may be far behind after a flood of output: `worker.torchrun.tails_of_files`)."""

from __future__ import annotations

from worker.protocol import round_mark
from worker.torchrun import headline, tails_of_files


def test_the_last_lines_of_each_rank_come_from_the_ends_of_the_files(tmp_path):
    out, err = tmp_path / "n0-attempt1.stdout", tmp_path / "n0-attempt1.stderr"
    flood = "".join(f"[rank0]:line {i} {'x' * 90}\n" for i in range(5000))  # ~500 KB
    out.write_text(flood + "[rank1]:last of rank 1\n" + round_mark(3) + "\n" + "[rank0]:done sk-secret1\n")
    err.write_text("[rank0]:Traceback (most recent call last):\n[rank0]:ValueError: boom\n"
                   "torchrun: worker failed\n")
    tails = tails_of_files([out, err], ("sk-secret1",), nbytes=4096)
    assert list(tails[0])[-3:] == ["done ***", "Traceback (most recent call last):", "ValueError: boom"]
    assert list(tails[0])[0].startswith("line ") and len(tails[0]) == 20  # whole lines only
    assert list(tails[1]) == ["last of rank 1"] and list(tails[None]) == ["torchrun: worker failed"]
    assert headline(tails, 1) == "rank 0: ValueError: boom (torchrun exited with code 1)"
