"""The torch.distributed rendezvous store that only one job can read or write: values
sealed under the job's secret, a stranger's reads and writes of no use, and a real gloo
group built through it on a real TCPStore on loopback (ranks as threads: no MPI)."""

from __future__ import annotations

import datetime
import secrets
import socket
import threading

import pytest

dist = pytest.importorskip("torch.distributed")
torch = pytest.importorskip("torch")

from nbdist.transport.sealed_store import SECRET_BYTES, SealedStore, TamperedRendezvous  # noqa: E402

TIMEOUT = datetime.timedelta(seconds=60)


def _server() -> tuple[dist.TCPStore, int]:
    listener = socket.create_server(("127.0.0.1", 0))
    port = listener.getsockname()[1]
    store = dist.TCPStore(
        "127.0.0.1", port, is_master=True, timeout=TIMEOUT, wait_for_workers=False, master_listen_fd=listener.detach()
    )
    return store, port


def test_a_value_is_sealed_under_the_jobs_secret():
    inner = dist.HashStore()
    secret = secrets.token_bytes(SECRET_BYTES)
    store = SealedStore(inner, secret)
    store.set("rank_0", b"127.0.0.1:41234 gloo address")
    store.set("text", "as a str")
    assert store.get("rank_0") == b"127.0.0.1:41234 gloo address" and store.get("text") == b"as a str"
    assert store.add("counter", 2) == 2 and store.add("counter", 1) == 3
    assert store.check(["rank_0", "counter"]) and not store.check(["rank_9"])
    store.wait(["rank_0"], datetime.timedelta(seconds=5))
    # The same job's other ranks (the same secret) read it; another secret finds nothing.
    assert SealedStore(inner, secret).get("rank_0") == b"127.0.0.1:41234 gloo address"
    other = SealedStore(inner, secrets.token_bytes(SECRET_BYTES))
    name = store.name("rank_0")
    assert not other.check(["rank_0"])  # its names are other names
    with pytest.raises(TamperedRendezvous):  # and the sealed value does not open for it
        other.open(name, inner.get(name))
    # What is in the store itself: no key name, no address.
    assert "rank_0" not in name and b"41234" not in inner.get(name) and b"127.0.0.1" not in inner.get(name)
    # Two sealings of one value differ (a fresh nonce each): equal values are not told apart.
    assert store.seal(name, b"same") != store.seal(name, b"same")


def test_append_and_compare_set_keep_their_meaning_through_torchs_own_calls():
    store = SealedStore(dist.HashStore(), secrets.token_bytes(SECRET_BYTES))
    via = dist.PrefixStore("group", store)  # C++ calling into the sealed store, as process groups do
    via.set("a", b"one")
    via.append("a", b"+two")
    assert via.get("a") == b"one+two" and via.multi_get(["a"]) == [b"one+two"]
    assert via.compare_set("new", "", "first") == b"first"  # absent: set
    assert via.compare_set("new", "", "second") == b"first"  # present: kept
    assert via.compare_set("new", "wrong", "third") == b"first"
    assert via.compare_set("new", "first", "third") == b"third" and via.get("new") == b"third"
    assert via.compare_set("absent", "something", "x") == b"something" and not via.check(["absent"])


def test_a_value_a_stranger_writes_or_moves_is_refused():
    inner = dist.HashStore()
    store = SealedStore(inner, secrets.token_bytes(SECRET_BYTES))
    store.set("a", b"first")
    store.set("b", b"second")
    inner.set(store.name("b"), inner.get(store.name("a")))  # a sealed value moved to another key
    with pytest.raises(TamperedRendezvous, match="not written by this job"):
        store.get("b")
    sealed = bytearray(inner.get(store.name("a")))
    sealed[20] ^= 1  # one bit of the ciphertext
    inner.set(store.name("a"), bytes(sealed))
    with pytest.raises(TamperedRendezvous):
        store.get("a")
    inner.set(store.name("c"), b"short")
    with pytest.raises(TamperedRendezvous):
        store.get("c")


def _gloo_group(rank: int, size: int, port: int, secret: bytes, server, out: dict) -> None:
    try:
        inner = server if rank == 0 else dist.TCPStore("127.0.0.1", port, is_master=False, timeout=TIMEOUT)
        sealed = SealedStore(inner, secret)
        options = dist.ProcessGroupGloo._Options()
        options._timeout = TIMEOUT
        options._devices = [dist.ProcessGroupGloo.create_device(hostname="127.0.0.1")]
        group = dist.ProcessGroupGloo(sealed, rank, size, options)
        tensor = torch.full((3,), float(rank + 1))
        group.allreduce([tensor]).wait()
        out[rank] = tensor.tolist()
    except Exception as exc:  # noqa: BLE001 - reported by the test
        out[rank] = exc


def test_a_gloo_group_rendezvous_through_the_sealed_store_and_a_stranger_learns_nothing():
    server, port = _server()
    secret = secrets.token_bytes(SECRET_BYTES)
    out: dict = {}
    threads = [threading.Thread(target=_gloo_group, args=(r, 2, port, secret, server, out)) for r in range(2)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(120)
    assert out == {0: [3.0] * 3, 1: [3.0] * 3}, out
    # Another process that connects to the store (it answers anyone) finds only sealed keys.
    stranger = dist.TCPStore("127.0.0.1", port, is_master=False, timeout=TIMEOUT)
    keys = stranger.list_keys()
    assert keys and all(k.startswith("nbdist-") for k in keys), keys
    for key in keys:
        value = stranger.get(key)
        assert b"127.0.0.1" not in value, (key, value)  # gloo's addresses are not readable


def test_a_group_whose_store_a_stranger_wrote_into_is_not_made():
    """The stranger plays rank 1: whatever it writes under rank 1's keys, rank 0 refuses."""
    server, port = _server()
    secret = secrets.token_bytes(SECRET_BYTES)
    names = SealedStore(server, secret)  # even knowing the key names (it cannot: they are secret)
    stranger = dist.TCPStore("127.0.0.1", port, is_master=False, timeout=TIMEOUT)
    for key in [f"{device}/1" for device in range(4)] + ["rank_1"]:
        stranger.set(names.name(key), b"127.0.0.1:1 from a stranger")
    out: dict = {}
    rank_0 = threading.Thread(target=_gloo_group, args=(0, 2, port, secret, server, out))
    rank_0.start()
    rank_0.join(120)
    assert not rank_0.is_alive(), "rank 0 waited on the stranger's values"
    assert isinstance(out[0], Exception) and "not written by this job" in str(out[0]), out
