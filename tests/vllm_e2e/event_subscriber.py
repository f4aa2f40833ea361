"""A KV-event subscriber in a process of its own, for tests that stop it (SIGSTOP) under load.

    python event_subscriber.py ENDPOINT OUT STOPPED_MARK RESUMED_MARK

It connects a ZMQ SUB socket to ``ENDPOINT`` (an ``ipc://`` one, which vLLM's publisher binds:
a Unix socket buffers ~200 KiB, where loopback TCP can buffer megabytes) with the smallest
buffers it can ask for (a 4 KiB kernel receive buffer, a receive high-water mark of 1) and
appends every message's payload to ``OUT`` as it arrives (a little-endian uint32 length, then the
msgpack bytes of vLLM's ``KVEventBatch``; the test decodes them with vLLM's own classes, so this
process needs only pyzmq and starts in a fraction of a second). After the first message it
creates ``STOPPED_MARK`` and stops itself with SIGSTOP, like a router process that hangs; once
someone sends it SIGCONT it creates ``RESUMED_MARK`` and goes on receiving until SIGTERM.
"""

from __future__ import annotations

import os
import signal
import struct
import sys
from pathlib import Path

import zmq


def main(endpoint: str, out: str, stopped: str, resumed: str) -> None:
    ctx = zmq.Context()
    sock = ctx.socket(zmq.SUB)
    sock.setsockopt(zmq.RCVBUF, 4096)
    sock.setsockopt(zmq.RCVHWM, 1)
    sock.setsockopt_string(zmq.SUBSCRIBE, "")
    sock.connect(endpoint)  # retried by ZMQ until vLLM has bound it
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(0))
    first = True
    with open(out, "ab", buffering=0) as f:
        while True:
            _topic, _seq, payload = sock.recv_multipart()
            f.write(struct.pack("<I", len(payload)) + payload)
            if first:
                first = False
                Path(stopped).write_text("stopped\n")
                os.kill(os.getpid(), signal.SIGSTOP)  # hangs here until SIGCONT
                Path(resumed).write_text("resumed\n")


def read_payloads(path: str | os.PathLike[str]) -> list[bytes]:
    """The payloads ``main`` wrote to ``path``, in arrival order."""
    data = Path(path).read_bytes()
    out, pos = [], 0
    while pos + 4 <= len(data):
        (n,) = struct.unpack_from("<I", data, pos)
        out.append(data[pos + 4 : pos + 4 + n])
        pos += 4 + n
    return out


if __name__ == "__main__":
    main(*sys.argv[1:5])
