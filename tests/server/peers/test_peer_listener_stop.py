"""A listener's ``stop`` ends the requests in progress and waits for them: once it returns, nothing of this listener
writes into the host's shared memory (a sidecar stopping, or a node's sidecar replaced, must not find files appearing
under it afterwards). A real caller on 127.0.0.1 offers a copy and sends it slowly; the listener is stopped midway."""

from __future__ import annotations

import threading
import time
from pathlib import Path

from ckptd.peers import PeerService
from ckptd.peers._protocol import RateLimit, connect
from ckptd.peers._requests import offer_part, send_part
from tests.server.peers.conftest import JOB
from tests.support.helpers import wait_until
from tests.support.peer_parts import SECRET, write_part
from trainer_client.core.format._peer_copies import copies_dir
from trainer_client.core.format._snapshot import read_meta


def test_stop_ends_a_copy_being_received_and_nothing_is_written_after_it_returns(
        pair: tuple[list[PeerService], list[Path]], tmp_path: Path) -> None:
    (_, s1), (_, shm1) = pair
    part = write_part(tmp_path / "origin-shm", JOB, 10, index=0, cols=8192)  # host 0's part, sent by hand below
    meta, raw = read_meta(part), (part / "snapshot.json").read_bytes()
    ended: list[BaseException] = []

    def send_slowly() -> None:
        try:
            with connect(s1.address, SECRET.encode(), timeout_s=30) as chan:
                assert not offer_part(chan, JOB, meta, len(raw), (10,), sender="").have
                with open(part / "data.bin", "rb") as data:  # 128 KiB at 16 KiB/s: 8 s unless cut short
                    send_part(chan, raw, data, meta.nbytes, RateLimit(16 << 10))
        except BaseException as exc:  # what ended the copy: asserted below
            ended.append(exc)

    sender = threading.Thread(target=send_slowly, daemon=True)
    sender.start()
    wait_until(lambda: ended or s1.listener._open, timeout=20, what="the copy being received")
    time.sleep(1.0)  # its bytes flowing
    assert not ended and s1.listener._open, f"the copy ended before the stop: {ended}"
    started = time.monotonic()
    s1.listener.stop(timeout_s=10)
    assert time.monotonic() - started < 10, "stop waited for the slow copy instead of ending it"
    assert s1.listener._open == {}, "a request's thread outlived stop"
    held = sorted(p.relative_to(shm1) for p in (shm1 / JOB).rglob("*"))
    time.sleep(0.5)  # a request still running would write on here
    assert sorted(p.relative_to(shm1) for p in (shm1 / JOB).rglob("*")) == held
    assert not (copies_dir(shm1, JOB, 0) / "10").exists(), "a copy cut short was kept"
    sender.join(timeout=30)
    assert ended, "the sender's copy was not ended by the stop"
