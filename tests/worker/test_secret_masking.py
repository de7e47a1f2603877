"""The agent masks a job's secret env values and its token in the output it ships (worker/torchrun.py)."""

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


PEM = ("-----BEGIN PRIVATE KEY-----\n"
       "MIIEvQIBADANBgkqhkiG9w0BAQEFAASCBKcwggSjAgEAAoIBAQC7\n"
       "  k3yLineWithBlanksAround  \r\n"
       "ab\n"
       "-----END PRIVATE KEY-----\n")


def test_each_line_of_a_multi_line_secret_is_masked_as_lines_are_shipped_one_by_one():
    secrets = secrets_to_mask({"KEY": PEM})
    assert {"MIIEvQIBADANBgkqhkiG9w0BAQEFAASCBKcwggSjAgEAAoIBAQC7", "k3yLineWithBlanksAround",
            "-----BEGIN PRIVATE KEY-----", "-----END PRIVATE KEY-----"} == set(secrets)  # not "ab"
    shipped = [mask_secrets(line, secrets) for line in PEM.splitlines()]
    assert shipped == [MASK, MASK, f"  {MASK}  ", "ab", MASK]
    quoted = "key: MIIEvQIBADANBgkqhkiG9w0BAQEFAASCBKcwggSjAgEAAoIBAQC7!"
    assert mask_secrets(quoted, secrets) == f"key: {MASK}!"


def test_the_job_token_is_masked_like_a_secret():
    token = "tok-0123456789abcdef"
    secrets = secrets_to_mask({"A": "abcd"}, token)
    assert secrets == (token, "abcd")
    assert mask_secrets(f"FTRAIN_JOB_TOKEN={token}", secrets) == f"FTRAIN_JOB_TOKEN={MASK}"
    assert secrets_to_mask({}, None) == ()
