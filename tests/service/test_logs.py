"""The log store on files (service/logs.py): pages by offset, the cap, the tail, torn writes.

Each test has its own log root under tmp_path. Two replicas appending to one job (two
processes on one directory) are in tests/integration/test_logs.py.
"""

from __future__ import annotations

import asyncio
import builtins
import json

import pytest

from service import logs as logs_module
from service.errors import LogStorageUnavailable
from service.logs import TAIL_MAX_BYTES, LogStore
from worker.protocol import LogLineIn, LogShipment

CAP = 64 * 1024


def shipment(node: str, *lines: tuple[int | None, str], attempt: int = 1) -> LogShipment:
    return LogShipment(node=node, attempt=attempt, lines=[
        LogLineIn(rank=rank, line=text, time=1.0) for rank, text in lines])


def run(coro):
    return asyncio.run(coro)


def read_all(store: LogStore, job: str, rank: int | None = None, limit: int = 1000) -> list:
    items, since = [], 0
    while True:
        page = run(store.read_page(job, since, limit, rank))
        items += page.items
        if page.next_seq >= page.end_seq:
            return items
        since = page.next_seq


def test_lines_read_back_in_order_resume_from_a_seq_and_filter_by_rank(tmp_path):
    store = LogStore(tmp_path, CAP)
    run(store.ship("j", shipment("a", (0, "a0"), (1, "a1"))))
    run(store.ship("j", shipment("b", (None, "agent says"), (0, "b0"))))
    run(store.ship("j", shipment("b")))  # nothing to store
    page = run(store.read_page("j"))
    assert [(x.node, x.rank, x.line, x.attempt) for x in page.items] == [
        ("a", 0, "a0", 1), ("a", 1, "a1", 1), ("b", None, "agent says", 1), ("b", 0, "b0", 1)]
    seqs = [x.seq for x in page.items]
    assert seqs == sorted(set(seqs)) and seqs[0] == 0
    assert page.next_seq == page.end_seq and (page.first_seq, page.cut_bytes, page.cut_lines) == (0, 0, 0)
    assert page.cap_bytes == CAP
    assert [x.line for x in run(store.read_page("j", since=seqs[1])).items] == ["a1", "agent says", "b0"]
    # A seq inside a line (a client that added 1 to the last seq it saw) starts at the next line.
    assert [x.line for x in run(store.read_page("j", since=seqs[1] + 1)).items] == ["agent says", "b0"]
    assert [x.line for x in run(store.read_page("j", rank=0)).items] == ["a0", "b0"]
    empty = run(store.read_page("j", since=page.next_seq))
    assert empty.items == [] and empty.next_seq == page.next_seq
    assert run(store.read_page("unknown")).items == []


def test_pages_hold_at_most_limit_lines_and_chain_by_next_seq(tmp_path):
    store = LogStore(tmp_path, CAP)
    for i in range(10):
        run(store.ship("j", shipment("a", *[(0, f"{i}.{k}") for k in range(5)])))
    first = run(store.read_page("j", limit=7))
    assert len(first.items) == 7 and first.next_seq < first.end_seq
    expected = [f"{i}.{k}" for i in range(10) for k in range(5)]
    assert [x.line for x in read_all(store, "j", limit=7)] == expected


def test_a_rank_filter_over_a_long_log_reads_a_bounded_amount_per_page(tmp_path, monkeypatch):
    monkeypatch.setattr(logs_module, "PAGE_SCAN_BYTES", 4096)
    store = LogStore(tmp_path, 1024 * 1024)
    for _ in range(50):
        run(store.ship("j", shipment("a", *[(1, "x" * 100)] * 20)))
    run(store.ship("j", shipment("a", (0, "the one"))))
    page = run(store.read_page("j", rank=0))
    assert page.items == [] and page.next_seq < page.end_seq  # stopped early: more to read
    assert [x.line for x in read_all(store, "j", rank=0)] == ["the one"]


def test_the_cap_keeps_the_newest_bytes_and_says_what_was_cut(tmp_path):
    store = LogStore(tmp_path, CAP)
    total_lines = 0
    for i in range(100):
        run(store.ship("j", shipment("a", *[(0, f"{i:03d}.{k:02d} " + "y" * 80) for k in range(10)])))
        total_lines += 10
    on_disk = sum(p.stat().st_size for p in (tmp_path / "j").glob("*.ndjson"))
    assert CAP - store.segment_bytes - 2048 <= on_disk <= CAP
    items = read_all(store, "j")
    page = run(store.read_page("j"))
    assert page.first_seq == page.cut_bytes == items[0].seq > 0
    assert page.cut_lines + len(items) == total_lines
    assert page.end_seq - page.first_seq == on_disk
    # What is kept is the newest lines, none missing in between.
    expected = [f"{i:03d}.{k:02d} " + "y" * 80 for i in range(100) for k in range(10)]
    assert [x.line for x in items] == expected[page.cut_lines:]
    # A reader that was behind the cut goes on from the oldest line kept.
    assert run(store.read_page("j", since=0, limit=1)).items[0].seq == page.first_seq


def test_last_lines_reads_only_the_tail(tmp_path, monkeypatch):
    store = LogStore(tmp_path, 64 * 1024 * 1024)
    for i in range(300):  # about 8 MiB
        run(store.ship("j", shipment("a", *[(i % 2, f"{i}.{k} " + "z" * 2700) for k in range(10)])))
    run(store.ship("j", shipment("a", (None, "agent note"), (1, "last but one"), (0, "last"))))
    read = []
    real_open = builtins.open

    def counting_open(path, mode="r", *args, **kwargs):
        f = real_open(path, mode, *args, **kwargs)
        real_read = f.read

        def read_(n=-1):
            data = real_read(n)
            read.append(len(data))
            return data

        f.read = read_
        return f

    monkeypatch.setattr(logs_module, "open", counting_open, raising=False)
    tail = run(store.last_lines("j", 3))
    assert tail[-2:] == ["[rank1] last but one", "[rank0] last"] and len(tail) == 3
    run(store.ship("j", LogShipment(node="a", attempt=1, lines=[
        LogLineIn(rank=0, line="failing", time=1.0, stream="stderr")])))
    assert run(store.last_lines("j", 1)) == ["[rank0 stderr] failing"]
    assert 0 < sum(read) <= TAIL_MAX_BYTES


def test_a_tail_page_of_a_multi_mib_log_reads_from_the_end(tmp_path, monkeypatch):
    store = LogStore(tmp_path, 64 * 1024 * 1024)
    for i in range(200):  # about 5.5 MiB
        run(store.ship("j", shipment("a", *[(i % 2, f"{i}.{k} " + "z" * 2700) for k in range(10)])))
    every = read_all(store, "j", limit=10_000)
    read = []
    real_open = builtins.open

    def counting_open(path, mode="r", *args, **kwargs):
        f = real_open(path, mode, *args, **kwargs)
        real_read = f.read
        f.read = lambda n=-1: read.append(len(data := real_read(n))) or data
        return f

    monkeypatch.setattr(logs_module, "open", counting_open, raising=False)
    page = run(store.read_tail("j", 5))
    assert page.items == every[-5:]
    assert page.next_seq == page.end_seq
    assert 0 < sum(read) <= 256 * 1024  # the end of a 5.5 MiB log, not all of it
    assert run(store.read_tail("j", 3, rank=1)).items == [x for x in every if x.rank == 1][-3:]
    assert run(store.read_tail("j", 0)).items == []
    # where the tail ends is where a follower goes on: the next line, nothing else
    run(store.ship("j", shipment("a", (0, "after the tail"))))
    after = run(store.read_page("j", page.next_seq, 100))
    assert [x.line for x in after.items] == ["after the tail"]
    # a log shorter than the tail: all of it
    run(store.ship("k", shipment("a", (0, "one"), (1, "two"))))
    assert [x.line for x in run(store.read_tail("k", 10)).items] == ["one", "two"]


def test_a_torn_write_costs_one_record_not_the_log(tmp_path):
    store = LogStore(tmp_path, CAP)
    run(store.ship("j", shipment("a", (0, "before"))))
    segment = next((tmp_path / "j").glob("*.ndjson"))
    with open(segment, "ab") as f:  # a writer that crashed in the middle of its write
        f.write(b'{"time":1.0,"node":"a","rank":0,"str')
    run(store.ship("j", shipment("a", (0, "after"))))
    assert [x.line for x in read_all(store, "j")] == ["before", "after"]


def test_lines_keep_any_text_they_were_shipped_with(tmp_path):
    store = LogStore(tmp_path, CAP)
    odd = ["tab\there", "ünïcödé ✓", 'quote " backslash \\', "new\nline", "\x00nul"]
    run(store.ship("j", shipment("a", *[(0, t) for t in odd])))
    assert [x.line for x in read_all(store, "j")] == odd


def test_delete_removes_the_jobs_files_only(tmp_path):
    store = LogStore(tmp_path, CAP)
    run(store.ship("j", shipment("a", (0, "x"))))
    run(store.ship("k", shipment("a", (0, "y"))))
    run(store.delete("j"))
    run(store.delete("j"))  # twice is fine
    assert not (tmp_path / "j").exists() and run(store.read_page("j")).items == []
    assert [x.line for x in read_all(store, "k")] == ["y"]


def test_a_job_id_is_never_a_path(tmp_path):
    store = LogStore(tmp_path / "root", CAP)
    for bad in ("..", "a/b", "."):
        with pytest.raises(ValueError):
            run(store.ship(bad, shipment("a", (0, "x"))))
    assert not (tmp_path / "a").exists()


def test_a_log_root_that_cannot_be_written_is_a_503_that_names_no_server_path(tmp_path, caplog):
    """The client hears what failed and who can fix it; the path is in the server's own log."""
    from service.errors import LogStorageUnavailable

    blocker = tmp_path / "file"
    blocker.write_text("not a directory")
    store = LogStore(blocker / "logs", CAP)
    with pytest.raises(LogStorageUnavailable) as err:
        run(store.ship("j", shipment("a", (0, "x"))))
    assert err.value.status_code == 503 and "Not a directory" in err.value.message
    assert str(tmp_path) not in err.value.message and str(blocker) in caplog.text
    # The failure reason's quote is best effort: it says why it is missing instead of failing.
    assert ["could not be read" in x for x in run(store.last_lines("j", 5))] == [True]


def test_records_on_disk_are_one_json_object_a_line(tmp_path):
    """The files are meant to be read by people and tools too (`jq`, `tail -f`)."""
    store = LogStore(tmp_path, CAP)
    run(store.ship("j", shipment("a", (0, "hello"))))
    raw = next((tmp_path / "j").glob("*.ndjson")).read_text()
    assert json.loads(raw) == {"time": 1.0, "node": "a", "attempt": 1, "rank": 0, "stream": "stdout",
                               "line": "hello"}


def test_a_read_lists_the_segments_again_when_the_cap_deletes_one_under_it(tmp_path, monkeypatch):
    store = LogStore(tmp_path, CAP)
    run(store.ship("j", shipment("a", (0, "a0"), (0, "a1"))))
    deletions = {"left": 2}

    def deleted_under_the_reader(original):
        def read(*args):
            if deletions["left"] > 0:
                deletions["left"] -= 1
                raise FileNotFoundError("a segment the cap deleted")
            return original(*args)
        return read

    monkeypatch.setattr(logs_module, "_last_bytes", deleted_under_the_reader(logs_module._last_bytes))
    monkeypatch.setattr(store, "_read_segments", deleted_under_the_reader(store._read_segments))
    assert [x.line for x in run(store.read_tail("j", 5)).items] == ["a0", "a1"]
    assert run(store.last_lines("j", 5)) == ["[rank0] a0", "[rank0] a1"]
    deletions["left"] = 2
    assert [x.line for x in run(store.read_page("j")).items] == ["a0", "a1"]
    # A log that keeps changing under every try is an error that says so, not a wrong page.
    deletions["left"] = logs_module._READ_TRIES
    with pytest.raises(LogStorageUnavailable, match="kept changing under the reader"):
        run(store.read_tail("j", 5))
