"""A torch.distributed store that only the ranks of one job can read or write.

torch's TCPStore answers whoever connects, without a password, and lists its keys to
anyone who asks (`list_keys`). What a process group puts there is what it takes to join
or spy on the group: gloo's pair addresses, NCCL's unique id (whose "magic" is the only
thing NCCL's sockets check). On a shared node every user reaches 127.0.0.1, and on a
cluster network every job does.

So the group's store is wrapped in this one, keyed by a secret of 32 random bytes that
rank 0 draws and hands to the others over MPI (the job's own channel, which no other
process can read: shared memory on one node, the job's MPI connections between nodes):

- a key is stored under HMAC(secret, key): its name says nothing;
- a value is stored sealed: a fresh 16-byte nonce, the value XOR-ed with SHAKE-256 of
  (secret, nonce) (SHAKE-256 as a keyed stream: a stranger cannot read it), and an
  HMAC-SHA256 tag over the key's name, the nonce and that ciphertext (encrypt, then
  MAC: a stranger cannot forge or move a value between keys); `append` adds one more
  such frame, and `compare_set` has the server compare the sealed bytes it read;
- every value read is checked: one that fails is an error naming the rendezvous as
  tampered with, and the group is not made. A stranger can still delete keys or spoil
  counters (`add`), which only stops the job, with that error or at its deadline.

One sub-key per purpose is derived from the secret with HMAC (names, stream, tags), so
that no key serves two ends. Everything here is Python's hashlib and hmac.
"""

from __future__ import annotations

import datetime
import hashlib
import hmac
import os
from collections.abc import Sequence
from typing import Any

import torch.distributed as dist

__all__ = ["SealedStore", "SECRET_BYTES", "TamperedRendezvous"]

SECRET_BYTES = 32
NONCE_BYTES = 16
TAG_BYTES = 32
LENGTH_BYTES = 4  # each sealed frame's length (a value appended to holds several frames)


class TamperedRendezvous(RuntimeError):
    """A value in the store that this job did not write (or that was changed)."""


def _subkey(secret: bytes, purpose: bytes) -> bytes:
    return hmac.new(secret, b"nbdist rendezvous " + purpose, hashlib.sha256).digest()


def _xor(data: bytes, stream: bytes) -> bytes:
    return (int.from_bytes(data, "big") ^ int.from_bytes(stream, "big")).to_bytes(len(data), "big")


class SealedStore(dist.Store):
    """`inner` (a TCPStore) with its keys hidden and its values sealed under `secret`."""

    def __init__(self, inner: dist.Store, secret: bytes):
        super().__init__()
        if len(secret) != SECRET_BYTES:
            raise ValueError(f"the rendezvous secret has {SECRET_BYTES} bytes, not {len(secret)}")
        # Any: torch's stubs say str for values the C++ store takes as bytes, and leave out append.
        self.inner: Any = inner
        self._names = _subkey(secret, b"names")
        self._stream = _subkey(secret, b"stream")
        self._tags = _subkey(secret, b"tags")

    # -- the sealing ----------------------------------------------------------------------
    def name(self, key: str) -> str:
        return "nbdist-" + hmac.new(self._names, key.encode(), hashlib.sha256).hexdigest()[:40]

    def seal(self, name: str, value: bytes) -> bytes:
        """One frame: its length, a fresh nonce, the value enciphered, the tag."""
        nonce = os.urandom(NONCE_BYTES)
        body = _xor(value, hashlib.shake_256(self._stream + nonce).digest(len(value)))
        frame = nonce + body + hmac.new(self._tags, name.encode() + nonce + body, hashlib.sha256).digest()
        return len(frame).to_bytes(LENGTH_BYTES, "big") + frame

    def open(self, name: str, sealed: bytes) -> bytes:
        """The value of a stored key: its frames (one per set or append) opened in turn."""
        sealed, out, at = bytes(sealed), [], 0
        while at < len(sealed):
            size = int.from_bytes(sealed[at : at + LENGTH_BYTES], "big")
            frame = sealed[at + LENGTH_BYTES : at + LENGTH_BYTES + size]
            at += LENGTH_BYTES + size
            nonce, body, tag = frame[:NONCE_BYTES], frame[NONCE_BYTES:-TAG_BYTES], frame[-TAG_BYTES:]
            expected = hmac.new(self._tags, name.encode() + nonce + body, hashlib.sha256).digest()
            if len(frame) != size or size < NONCE_BYTES + TAG_BYTES or not hmac.compare_digest(tag, expected):
                raise TamperedRendezvous(
                    "a value in the torch.distributed rendezvous store was not written by this job: "
                    "another process wrote into it (the group is not made)"
                )
            out.append(_xor(body, hashlib.shake_256(self._stream + nonce).digest(len(body))))
        if not out:
            raise TamperedRendezvous("an empty value in the torch.distributed rendezvous store: not this job's")
        return b"".join(out)

    # -- the store's interface, as torch's process groups call it --------------------------
    def set(self, key: str, value: bytes | str) -> None:
        name = self.name(key)
        self.inner.set(name, self.seal(name, _bytes(value)))

    def get(self, key: str) -> bytes:
        name = self.name(key)
        return self.open(name, self.inner.get(name))

    def append(self, key: str, value: bytes | str) -> None:
        name = self.name(key)
        self.inner.append(name, self.seal(name, _bytes(value)))  # one more frame, appended by the server

    def compare_set(self, key: str, expected: bytes | str, desired: bytes | str) -> bytes:
        """Set `desired` if the value is `expected` (or the key is absent and `expected` is
        empty); returns the value now. Atomic: the server compares the sealed bytes read."""
        name, expected = self.name(key), _bytes(expected)
        current = self.inner.get(name) if self.inner.check([name]) else b""
        if current and self.open(name, current) != expected:
            return self.open(name, current)
        if not current and expected:
            return expected  # absent: nothing to compare with (the TCPStore's answer too)
        now = self.inner.compare_set(name, current, self.seal(name, _bytes(desired)))
        return self.open(name, now) if now else b""

    def add(self, key: str, amount: int) -> int:
        return self.inner.add(self.name(key), amount)  # a counter: hidden, not sealed

    def check(self, keys: Sequence[str]) -> bool:
        return self.inner.check([self.name(k) for k in keys])

    def wait(self, keys: Sequence[str], timeout: datetime.timedelta | None = None) -> None:
        names = [self.name(k) for k in keys]
        if timeout is None:
            self.inner.wait(names)
        else:
            self.inner.wait(names, timeout)

    def delete_key(self, key: str) -> bool:
        return self.inner.delete_key(self.name(key))

    def num_keys(self) -> int:
        return self.inner.num_keys()

    def set_timeout(self, timeout: datetime.timedelta) -> None:
        self.inner.set_timeout(timeout)


def _bytes(value: bytes | str) -> bytes:
    return value.encode() if isinstance(value, str) else bytes(value)
