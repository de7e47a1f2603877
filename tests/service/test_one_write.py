"""`service.one_write`: an answer's head and body in one socket write, in order, and what
is held sent before a close."""

from __future__ import annotations

import asyncio

from service.one_write import _OneWrite


class Transport:
    def __init__(self) -> None:
        self.writes: list[bytes] = []
        self.closed = False

    def write(self, data: bytes) -> None:
        self.writes.append(data)

    def is_closing(self) -> bool:
        return self.closed

    def close(self) -> None:
        self.closed = True

    def get_write_buffer_size(self) -> int:
        return 0


def test_the_writes_of_one_step_go_out_as_one_in_order_and_a_close_sends_them_first():
    async def main() -> None:
        raw = Transport()
        t = _OneWrite(raw, asyncio.get_running_loop())
        t.write(b"HTTP/1.1 200 OK\r\ncontent-length: 2\r\n\r\n")
        t.write(b"{}")
        assert raw.writes == [] and t.get_write_buffer_size() == 40
        await asyncio.sleep(0)  # the step ends
        assert raw.writes == [b"HTTP/1.1 200 OK\r\ncontent-length: 2\r\n\r\n{}"]
        t.write(b"chunk 1")  # a streamed answer: each step's chunk on its own
        await asyncio.sleep(0)
        t.write(b"chunk 2")
        t.close()
        assert raw.writes[1:] == [b"chunk 1", b"chunk 2"] and raw.closed
        await asyncio.sleep(0)  # the flush scheduled for chunk 2 finds nothing more
        assert len(raw.writes) == 3 and t.is_closing()

    asyncio.run(main())
