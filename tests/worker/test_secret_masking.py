"""The agent masks a job's secret env values in the output it ships (worker/torchrun.py)."""

from __future__ import annotations

from worker.torchrun import MASK, mask_secrets, secrets_to_mask


def test_every_secret_value_is_masked_the_longest_first():
    secrets = secrets_to_mask({"A": "abcd", "B": "abcdefgh", "C": "xyz1"})
    assert secrets == ("abcdefgh", "abcd", "xyz1")
    line = "key=abcdefgh short=abcd other=xyz1xyz1"
    assert mask_secrets(line, secrets) == f"key={MASK} short={MASK} other={MASK}{MASK}"


def test_values_too_short_to_mask_are_left_alone():
    # masking "1" would mask every "1" of every line
    assert secrets_to_mask({"DEBUG": "1", "MODE": "on"}) == ()
    assert mask_secrets("step 1 on", ()) == "step 1 on"
