"""The node's GPUs: `--gpus`, CUDA_VISIBLE_DEVICES narrowing nvidia-smi's list, the split of
`ftrain up`."""

from __future__ import annotations

import pytest

from worker.gpus import Gpu, parse_gpus, split, visible

LISTED = [Gpu("0", "GPU-aaaa", "Fake H100"), Gpu("1", "GPU-bbbb", "Fake H100"),
          Gpu("2", "GPU-cccc", "Fake A10")]


@pytest.mark.parametrize("value, ids", [("0,1", ["0", "1"]), (" 2 ", ["2"]), ("none", []), ("", []),
                                        ("GPU-aaaa", ["GPU-aaaa"])])
def test_parse_gpus(value, ids):
    assert parse_gpus(value) == ids


@pytest.mark.parametrize("value", ["0,,1", "0,0", "0 1"])
def test_parse_gpus_refuses(value):
    with pytest.raises(ValueError):
        parse_gpus(value)


@pytest.mark.parametrize("cvd, names", [
    (None, ["0", "1", "2"]),      # unset: all
    ("2,0", ["2", "0"]),          # in its order
    ("1,7,2", ["1"]),             # CUDA stops at the first id it cannot match
    ("", []), ("-1", []),
    ("GPU-bbbb", ["1"]),          # by UUID (a prefix will do)
])
def test_visible_narrows_the_list(cvd, names):
    assert [g.index for g in visible(LISTED, cvd)] == names


def test_visible_without_nvidia_smi_counts_the_ids():
    assert visible([], "0,1") == 2 and visible([], "") == 0 and visible([], "-1") == 0
    assert visible([], None) == []


@pytest.mark.parametrize("n, parts, shares", [
    (2, 2, [["0"], ["1"]]),
    (4, 2, [["0", "1"], ["2", "3"]]),
    (3, 2, [["0", "1"], ["2"]]),
    (1, 2, [["0"], []]),
    (0, 2, [[], []]),
])
def test_split(n, parts, shares):
    assert split([str(i) for i in range(n)], parts) == shares
