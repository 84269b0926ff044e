"""A client of the peer tier's replica servers that is no rank of the job: the outsider of issue 54, who knows the job
id and the checkpoint path (so the job key) and maybe another job's secret, but not this job's. Used by
``tests/checkpoint/test_peer_auth.py`` (one process, real servers on 127.0.0.1) and
``tests/resiliency/test_peer_tier.py`` (against a running two-node job)."""

from __future__ import annotations

import socket
from typing import Any

from trainer.checkpoint import replicas
from trainer.checkpoint.peerauth import PeerAuth

OTHER_SECRET = b"another job's secret, 32 bytes or more"
ATTACK_SLOT = 7
"""The slot index the outsider's puts name: no job of the tests has that many slots, so a file of it is the
outsider's."""
ONE_MIB = 1 << 20


def requests(job: str) -> list[tuple[str, dict[str, Any], bytes, int]]:
    """(what, request head, blob, raw bytes sent after it) of every attempt: a fetch of rank 0's snapshot of every
    even step up to 40 (the job holds some of them), a put of 1 MiB, and a put that asks for 1 TiB; each unsigned,
    then signed with another job's secret under this job's key."""
    plain = [(f"fetch of step {step}", {"op": "get", "rank": 0, "step": step}, b"", 0) for step in range(2, 41, 2)]
    plain.append(("fetch of a cut", {"op": "get_cut", "rank": 0, "step": 2, "world": 3, "data": True}, b"", 0))
    plain.append(("put", {"op": "put", "rank": 0, "slot": ATTACK_SLOT, "step": 1, "nbytes": ONE_MIB}, b"x" * 64,
                  ONE_MIB))
    plain.append(("oversize put", {"op": "put", "rank": 0, "slot": ATTACK_SLOT, "step": 1, "nbytes": 1 << 40},
                  b"x" * 64, ONE_MIB))
    other = PeerAuth(OTHER_SECRET, job)
    signed = [(f"{what} signed with another job's secret", other.sign("request", head, blob), blob, extra)
              for what, head, blob, extra in plain]
    return [(f"unsigned {what}", head, blob, extra) for what, head, blob, extra in plain] + signed


def attack(address: tuple[str, int], job: str, source: str = "127.0.0.1") -> dict[str, tuple[dict[str, Any], int]]:
    """Every request of `requests` to the server at `address`, from the address `source`; what came back for each:
    (the answer's head, the bytes that followed it)."""
    got = {}
    for what, head, blob, extra in requests(job):
        with socket.create_connection(address, timeout=30, source_address=(source, 0)) as sock:
            replicas._send(sock, head, blob)
            try:
                if extra:
                    sock.sendall(bytes(extra))
            except OSError:  # the server closed it, as it should
                pass
            try:
                head, blob = replicas._receive(sock)
            except OSError:  # reset: the server closed it with the outsider's bytes unread
                head, blob = {"ok": False, "why": "reset"}, b""
            rest = 0
            sock.settimeout(5)
            try:
                while chunk := sock.recv(1 << 16):
                    rest += len(chunk)
            except OSError:
                pass
        got[what] = (head, len(blob) + rest)
    return got


def assert_nothing_got(got: dict[str, tuple[dict[str, Any], int]]) -> None:
    """Every attempt refused: no snapshot header, no byte of state, no signed answer."""
    for what, (answer, nbytes) in got.items():
        assert answer.get("ok") is False and "mac" not in answer and nbytes == 0, f"{what}: {answer} + {nbytes} bytes"
