"""The channel between rank 0's engine loop and the HTTP front end: the engine end never blocks on a peer that does
not read, frames arrive whole and in order however the bytes are cut, and a peer that goes away shows as `closed`."""
import random
import socket
import threading
import time

from tp_lora.server.channel import EngineEnd, encode, read_frame_blocking


def test_send_never_blocks_on_a_peer_that_does_not_read():
    mine, theirs = socket.socketpair()
    end = EngineEnd(mine)
    frames = [{"deltas": [(i, list(range(i % 7)), [0.5] * (i % 7), [])], "pad": bytes(100_000)} for i in range(200)]
    t0 = time.monotonic()
    for f in frames:  # 20 MB, far beyond the socket's buffer
        end.send(f)
        assert end.receive(0.0) == []
    assert time.monotonic() - t0 < 5 and not end.closed
    got = []
    reader = threading.Thread(target=lambda: got.extend(read_frame_blocking(theirs) for _ in frames))
    reader.start()
    assert end.drain_out(30)
    reader.join(30)
    assert got == frames


def test_frames_arrive_whole_and_in_order_however_the_bytes_are_cut():
    mine, theirs = socket.socketpair()
    end = EngineEnd(mine)
    rng = random.Random(0)
    ops = [[("add", i, rng.random(), True), ("cancel", i)] for i in range(50)]
    data = b"".join(encode(o) for o in ops)
    got, pos = [], 0
    while pos < len(data):
        n = rng.randint(1, 40)
        theirs.sendall(data[pos:pos + n])
        pos += n
        got += end.receive(0.05)
    assert got == ops
    t0 = time.monotonic()
    assert end.receive(0.2) == [] and 0.15 < time.monotonic() - t0 < 2  # waits for the next frame, up to `wait`
    theirs.close()
    assert end.receive(0.0) == [] and end.closed
    end.send({"gauges": (0, 0, 1.0, 0, 0)})  # after the peer left: dropped, no error
