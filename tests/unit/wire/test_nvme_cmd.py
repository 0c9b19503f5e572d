"""NVMe command and data structure layouts, checked at the byte offsets of the reference
(`shared/ref/nvme-tcp-kv.md`), and the NVMe status <-> exception table."""

from __future__ import annotations

import struct

import pytest
from hypothesis import given
from hypothesis import strategies as st

from kvoffload.errors import (
    AuthError,
    CapacityError,
    ConfigError,
    InvalidArgumentError,
    KVOffloadError,
    LocalProtocolError,
    RemoteProtocolError,
    StorageIOError,
    TransportError,
)
from kvoffload.wire.nvme_tcp import cmd as nc
from kvoffload.wire.nvme_tcp import data as nd
from kvoffload.wire.nvme_tcp.cmd import CmdSc, Command, Completion, Direction, Sc, Sct, Sgl
from kvoffload.wire.status import nvme_error_for, nvme_status_of

U32 = st.integers(0, 2**32 - 1)


@given(
    st.integers(0, 255),
    st.integers(0, 2**16 - 1),
    st.lists(U32, min_size=9, max_size=9),
    st.integers(0, 2**64 - 1),
    st.integers(0, 255),
)
def test_sqe_round_trips(opc: int, cid: int, dws: list[int], addr: int, stype: int) -> None:
    cmd = Command(opc, cid, dws[0], dws[1], dws[2], Sgl(addr, dws[3], stype), *dws[3:], flags=0x40)
    raw = cmd.pack()
    assert len(raw) == 64 and Command.unpack(raw) == cmd


@given(st.integers(0, 2**16 - 1), st.integers(0, 2**16 - 1), U32, U32)
def test_cqe_round_trips(cid: int, status: int, dw0: int, dw1: int) -> None:
    cqe = Completion(cid, status, dw0, dw1, sqhd=3, sqid=2)
    raw = cqe.pack()
    assert len(raw) == 16 and Completion.unpack(raw) == cqe
    assert struct.unpack_from("<IIHHHH", raw) == (dw0, dw1, 3, 2, cid, status)


def test_status_field() -> None:
    status = Completion.encode_status(Sct.GENERIC, Sc.KV_KEY_NOT_EXISTS, dnr=True)
    assert status == (0x87 << 1) | (1 << 15)
    c = Completion(1, status)
    assert (c.sct, c.sc, c.dnr, c.ok) == (0, 0x87, True, False)
    c = Completion(1, Completion.encode_status(Sct.COMMAND_SPECIFIC, CmdSc.CONNECT_INVALID_HOST))
    assert (c.sct, c.sc) == (1, 0x84)


def test_kv_key_and_fields_sit_where_the_kv_spec_puts_them() -> None:
    key = bytes(range(1, 17))
    raw = nc.kv_store(7, 3, key, 4096, in_capsule=False, options=2).pack()
    assert raw[0] == 0x01 and raw[1] == 0x40 and struct.unpack_from("<HI", raw, 2) == (7, 3)
    assert raw[8:16] == key[:8] and raw[56:64] == key[8:]  # CDW2..3 and CDW14..15
    assert raw[39] == 0x5A and struct.unpack_from("<I", raw, 32)[0] == 4096  # transport SGL
    assert struct.unpack_from("<I", raw, 40)[0] == 4096  # CDW10: value size
    assert raw[44] == 16 and raw[45] == 2  # CDW11: key length, options
    short = nc.kv_exist(1, 1, b"abc")
    assert nc.kv_key(short) == b"abc" and short.pack()[8:16] == b"abc\0\0\0\0\0"
    assert nc.kv_key(Command.unpack(raw)) == key
    inline = nc.kv_store(1, 1, key, 10, in_capsule=True).sgl
    assert (inline.type, inline.address, inline.length) == (0x01, 0, 10)
    with pytest.raises(LocalProtocolError):
        nc.kv_exist(1, 1, bytes(17))


def test_opcodes_and_directions() -> None:
    assert [int(o) for o in nc.KvOpc] == [0x01, 0x02, 0x06, 0x10, 0x14]
    assert nc.kv_store(1, 1, b"k", 1, in_capsule=True).direction is Direction.TO_CONTROLLER
    assert nc.kv_retrieve(1, 1, b"k", 1).direction is Direction.TO_HOST
    assert nc.kv_list(1, 1, b"", 8).direction is Direction.TO_HOST
    assert nc.kv_exist(1, 1, b"k").direction is Direction.NONE
    assert nc.kv_delete(1, 1, b"k").direction is Direction.NONE
    assert nc.identify(1, 1).direction is Direction.TO_HOST
    assert nc.connect(1, 0, 31).direction is Direction.TO_CONTROLLER
    assert nc.property_get(1, 0, True).direction is Direction.NONE


def test_fabrics_commands() -> None:
    raw = nc.connect(4, 2, 127, 15000).pack()
    assert raw[0] == 0x7F and raw[4] == 0x01  # FCTYPE Connect at byte 4
    assert raw[39] == 0x01 and struct.unpack_from("<I", raw, 32)[0] == 1024
    assert struct.unpack_from("<HHHBxI", raw, 40) == (0, 2, 127, 0, 15000)
    raw = nc.property_set(5, 0x14, 0x460001).pack()
    assert (
        raw[4] == 0x00 and raw[40] == 0 and struct.unpack_from("<IQ", raw, 44) == (0x14, 0x460001)
    )
    raw = nc.property_get(6, 0, True).pack()
    assert raw[4] == 0x04 and raw[40] == 1


def test_admin_commands() -> None:
    raw = nc.identify(1, nd.Cns.CSI_NAMESPACE, nsid=3, csi=nd.Csi.KV).pack()
    assert (
        raw[0] == 0x06
        and raw[40] == 5
        and raw[47] == 1
        and struct.unpack_from("<I", raw, 4)[0] == 3
    )
    raw = nc.get_log_page(1, nd.Lid.EFFECTS, 4096, csi=1).pack()
    lid, numdl, numdu = struct.unpack_from("<HHH", raw, 40)
    assert lid == 5 and numdl == 1023 and numdu == 0 and raw[59] == 1  # CDW14[31:24]: CSI
    raw = nc.set_features(1, 0x07, 0x00030003).pack()
    assert raw[0] == 0x09 and struct.unpack_from("<II", raw, 40) == (7, 0x30003)


def test_connect_data() -> None:
    data = nd.ConnectData(bytes(range(16)), 0xFFFF, "nqn.sub:x", "nqn.host:y")
    raw = data.pack()
    assert len(raw) == 1024 and raw[:16] == bytes(range(16)) and raw[16:18] == b"\xff\xff"
    assert raw[256:265] == b"nqn.sub:x" and raw[265] == 0 and raw[512:522] == b"nqn.host:y"
    assert nd.ConnectData.unpack(raw) == data
    with pytest.raises(LocalProtocolError):
        nd.nqn_bytes("x" * 224)


def test_identify_controller_offsets() -> None:
    ctrl = nd.IdentifyController(cntlid=9, subnqn="nqn.a:b", sn="SN1", maxcmd=64, nn=2, ioccsz=260)
    raw = ctrl.pack()
    assert len(raw) == 4096 and raw[4:7] == b"SN1" and raw[7] == 0x20
    assert struct.unpack_from("<H", raw, 78)[0] == 9  # CNTLID
    assert struct.unpack_from("<H", raw, 320)[0] == 1  # KAS
    assert raw[261] == 0x02  # LPA: commands supported and effects
    assert struct.unpack_from("<BBHI", raw, 512) == (0x66, 0x44, 64, 2)
    assert struct.unpack_from("<I", raw, 536)[0] == 0x00100001  # SGLS
    assert raw[768:775] == b"nqn.a:b"
    assert struct.unpack_from("<IIH", raw, 1792) == (260, 1, 0)  # IOCCSZ, IORCSZ, ICDOFF
    back = nd.IdentifyController.unpack(raw)
    assert back == ctrl and back.in_capsule_bytes == 260 * 16 - 64


def test_namespace_structures() -> None:
    kv = nd.KvNamespace(1 << 30, 1 << 20, 64 << 20, nguid=bytes(range(16)))
    raw = kv.pack()
    assert (
        struct.unpack_from("<Q", raw, 0)[0] == 1 << 30
        and struct.unpack_from("<Q", raw, 16)[0] == 1 << 20
    )
    assert raw[25] == 0  # NKVF, 0's based: one format
    assert struct.unpack_from("<HxxI", raw, 72) == (16, 64 << 20)  # KVKML, KVVML of format 0
    assert raw[48:64] == bytes(range(16)) and nd.KvNamespace.unpack(raw) == kv
    shim = nd.NvmNamespaceShim(100, 5).pack()
    assert struct.unpack_from("<QQQ", shim, 0) == (100, 100, 5) and shim[130] == 12  # LBADS
    assert nd.NvmNamespaceShim.unpack(shim).ncap == 100
    indep = nd.NamespaceIndependent().pack()
    assert indep[14] & 1 == 1  # NSTAT.NRDY
    assert struct.unpack_from("<I", nd.kv_controller(), 0)[0] == 0x00010300


def test_namespace_lists() -> None:
    raw = nd.pack_active_namespaces([3, 1, 7], above=1)
    assert struct.unpack_from("<III", raw) == (3, 7, 0) and nd.active_namespaces(raw) == [3, 7]
    raw = nd.pack_descriptors([(nd.Nidt.NGUID, bytes(16)), (nd.Nidt.CSI, b"\x01")])
    assert raw[:4] == b"\x02\x10\x00\x00" and raw[20:25] == b"\x04\x01\x00\x00\x01"
    assert nd.descriptors(raw) == {2: bytes(16), 4: b"\x01"}
    with pytest.raises(LocalProtocolError):
        nd.descriptors(b"\x04\x02\x00\x00\x01\x01" + bytes(10))  # a 2-byte CSI


def test_log_pages() -> None:
    raw = nd.EffectsLog({0x06: 1}, {0x01: 3, 0x14: 1}).pack()
    assert struct.unpack_from("<I", raw, 4 * 6)[0] == 1
    assert (
        struct.unpack_from("<I", raw, 1024 + 4)[0] == 3
        and struct.unpack_from("<I", raw, 1024 + 80)[0] == 1
    )
    assert nd.EffectsLog.unpack(raw) == nd.EffectsLog({6: 1}, {1: 3, 0x14: 1})
    smart = nd.SmartLog(temperature_k=300, data_units_read=5, host_writes=2**70)
    assert nd.SmartLog.unpack(smart.pack()) == smart


@given(st.lists(st.binary(min_size=1, max_size=16), max_size=40), st.integers(4, 1000))
def test_list_data_round_trips(keys: list[bytes], limit: int) -> None:
    raw, count = nd.pack_list_data(keys, limit)
    assert len(raw) <= limit and struct.unpack_from("<I", raw)[0] == count
    assert nd.list_data(raw) == keys[:count]
    for n in range(len(raw)):  # a host buffer cut anywhere yields a prefix
        assert nd.list_data(raw[:n]) == keys[: len(nd.list_data(raw[:n]))]


def test_list_entries_are_padded_to_dwords() -> None:
    raw, count = nd.pack_list_data([b"abc", bytes(16)], 100)
    assert count == 2 and raw[4:12] == b"\x03\x00abc\x00\x00\x00" and len(raw) == 4 + 8 + 20


@pytest.mark.parametrize(
    ("exc", "sct", "sc", "dnr"),
    [
        (CapacityError("full"), 0, 0x81, False),
        (InvalidArgumentError("too big"), 0, 0x85, True),
        (StorageIOError("EIO"), 0, 0x88, False),
        (KVOffloadError("?"), 0, 0x06, False),
    ],
)
def test_errors_to_nvme_status(exc: KVOffloadError, sct: int, sc: int, dnr: bool) -> None:
    c = Completion(1, nvme_status_of(exc))
    assert (c.sct, c.sc, c.dnr) == (sct, sc, dnr)


@pytest.mark.parametrize(
    ("sct", "sc", "cls"),
    [
        (0, 0x81, CapacityError),
        (0, 0x85, InvalidArgumentError),
        (0, 0x86, InvalidArgumentError),
        (0, 0x88, StorageIOError),
        (0, 0x22, TransportError),
        (0, 0x04, TransportError),
        (0, 0x0B, ConfigError),
        (0, 0x02, RemoteProtocolError),
        (1, 0x84, AuthError),
        (1, 0x82, ConfigError),
        (3, 0x42, KVOffloadError),
    ],
)
def test_nvme_status_to_errors(sct: int, sc: int, cls: type[KVOffloadError]) -> None:
    error = nvme_error_for(Completion.encode_status(sct, sc), "Store")
    assert type(error) is cls and "Store" in str(error)


def test_every_error_the_daemon_answers_comes_back_as_itself() -> None:
    for exc in (CapacityError("x"), InvalidArgumentError("x"), StorageIOError("x"), AuthError("x")):
        assert type(nvme_error_for(nvme_status_of(exc), "")) is type(exc)
