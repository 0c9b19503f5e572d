"""The List directory of a KV namespace."""

from __future__ import annotations

from kvoffload.nvmeof_target.nvme.keydir import KeyDirectory


def test_keys_come_back_in_byte_order_from_a_start_key() -> None:
    d = KeyDirectory()
    for key in (b"b", b"a", b"c\x00", b"c"):
        d.add(key, key.ljust(16, b"!"))
    assert [k for k, _ in d.from_key(b"")] == [b"a", b"b", b"c", b"c\x00"]
    assert [k for k, _ in d.from_key(b"b")] == [b"b", b"c", b"c\x00"]  # inclusive
    d.remove(b"b")
    d.remove(b"zz")  # absent: nothing happens
    assert [k for k, e in d.from_key(b"a")] == [b"a", b"c", b"c\x00"] and len(d) == 3


def test_a_sweep_drops_gone_keys_but_not_ones_stored_meanwhile() -> None:
    d = KeyDirectory()
    for i in range(5000):
        d.add(i.to_bytes(4, "big"), i.to_bytes(16, "big"))
    assert d.needs_sweep
    check = d.begin_sweep()
    assert not d.needs_sweep  # one sweep at a time
    d.add((1).to_bytes(4, "big"), (1).to_bytes(16, "big"))  # stored again while it runs
    gone = check(lambda engine_key: int.from_bytes(engine_key, "big") % 2 == 0)
    d.end_sweep(gone)
    kept = {int.from_bytes(k, "big") for k, _ in d.from_key(b"")}
    assert kept == {i for i in range(5000) if i % 2 == 0} | {1}
    assert not d.needs_sweep  # the next sweep waits until the directory has doubled


def test_a_failed_sweep_forgets_nothing() -> None:
    d = KeyDirectory()
    for i in range(5000):
        d.add(i.to_bytes(4, "big"), bytes(16))
    d.begin_sweep()
    d.end_sweep(None)
    assert len(d) == 5000
