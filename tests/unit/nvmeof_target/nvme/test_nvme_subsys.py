"""Controllers of the NVMe/TCP front without sockets: properties, features, Identify, logs,
who sees which namespace and which engine key a namespace key becomes."""

from __future__ import annotations

import struct
from dataclasses import replace

import pytest

from kvoffload.nvmeof_target.config import (
    NamespaceConfig,
    NvmeConfig,
    SubsystemConfig,
    TenantConfig,
)
from kvoffload.nvmeof_target.nvme.subsys import (
    LOG_PAD_MAX,
    CommandFailed,
    Controller,
    StoreInfo,
    build_subsystems,
)
from kvoffload.nvmeof_target.tenants import Tenants
from kvoffload.wire.nvme_tcp import cmd as nc
from kvoffload.wire.nvme_tcp import data as nd
from kvoffload.wire.nvme_tcp.cmd import Completion

A = "nqn.2014-08.org.nvmexpress:uuid:a"
B = "nqn.2014-08.org.nvmexpress:uuid:b"
SUB = "nqn.2026-11.io.kvoffload:store"
INFO = StoreInfo(1 << 30, 1 << 20, 5 << 20, 7 << 20, 3, 4, 7300.0)
CC_ENABLE = (6 << 16) | (4 << 20) | (6 << 4) | 1


def _store() -> StoreInfo:
    return INFO


def _controller(host: str = A, *, enable: bool = True, **nvme: object) -> Controller:
    config = NvmeConfig(
        subsystems=(
            SubsystemConfig(
                SUB,
                allow_hosts=(A, B),
                namespaces=(NamespaceConfig(1, "alice", (A,)), NamespaceConfig(2, "bob")),
            ),
        ),
        **nvme,  # type: ignore[arg-type]
    )
    tenants = Tenants([TenantConfig("alice", "x"), TenantConfig("bob", "y")])
    sub = build_subsystems(config, tenants.named)[SUB]
    ctrl = Controller(7, sub, host, bytes(16), 15000, config, max_value=64 << 20)
    if enable:
        ctrl.set_cc(CC_ENABLE)
    return ctrl


def _status(exc: CommandFailed) -> tuple[int, int]:
    c = Completion(0, exc.status)
    return c.sct, c.sc


def test_cap_vs_and_enable() -> None:
    ctrl = _controller(enable=False)
    assert ctrl.property_get(0x00, True) == 0x000008201E01007F  # the ref's recommended CAP
    assert ctrl.property_get(0x08, False) == 0x00020000
    assert ctrl.property_get(0x1C, False) == 0 and not ctrl.ready
    ctrl.property_set(0x14, CC_ENABLE, False)
    assert ctrl.property_get(0x1C, False) == 1 and ctrl.ready
    assert ctrl.property_get(0x14, False) == CC_ENABLE
    ctrl.property_set(0x14, CC_ENABLE | (1 << 14), False)  # normal shutdown
    assert ctrl.property_get(0x1C, False) == 0x9 and not ctrl.ready  # RDY and SHST = 10b
    ctrl.property_set(0x14, 0, False)
    assert ctrl.property_get(0x1C, False) == 0


@pytest.mark.parametrize(
    "cc",
    [
        (7 << 16) | (4 << 20) | 1,  # IOSQES 128 B
        (6 << 16) | (4 << 20) | (1 << 4) | 1,  # CSS 001b
        (6 << 16) | (4 << 20) | (1 << 7) | 1,  # MPS 8 KiB, beyond CAP.MPSMAX
    ],
)
def test_a_bad_cc_is_a_controller_fatal_status(cc: int) -> None:
    ctrl = _controller(enable=False)
    ctrl.set_cc(cc)
    assert ctrl.property_get(0x1C, False) & 0x2 and not ctrl.ready


@pytest.mark.parametrize(("offset", "eight"), [(0x00, False), (0x08, True), (0x20, False)])
def test_unknown_properties_and_sizes_are_invalid_fields(offset: int, eight: bool) -> None:
    with pytest.raises(CommandFailed) as info:
        _controller().property_get(offset, eight)
    assert _status(info.value) == (0, 0x02)
    with pytest.raises(CommandFailed):
        _controller().property_set(0x00, 1, True)  # CAP is read-only


def test_features() -> None:
    ctrl = _controller(max_io_queues=4)
    assert ctrl.set_feature(0x07, (9 << 16) | 1, False) == (1 | (3 << 16))  # capped, 0's based
    assert ctrl.granted_queues == 2 and ctrl.get_feature(0x07, 0) == (1 | (1 << 16))
    assert ctrl.set_feature(0x0F, 1050, False) == 0 and ctrl.get_feature(0x0F, 0) == 1100
    assert ctrl.set_feature(0x0B, 0x100, False) == 0 and ctrl.get_feature(0x0B, 0) == 0x100
    for fid in (0x06, 0x0E):
        with pytest.raises(CommandFailed):
            ctrl.set_feature(fid, 0, False)
        with pytest.raises(CommandFailed):
            ctrl.get_feature(fid, 0)
    with pytest.raises(CommandFailed) as info:
        ctrl.set_feature(0x07, 0xFFFF, False)
    assert _status(info.value) == (0, 0x02)
    ctrl.connected_queues = 1
    with pytest.raises(CommandFailed) as info:
        ctrl.set_feature(0x07, 0, False)
    assert _status(info.value) == (0, 0x0C)


def test_keep_alive_expiry() -> None:
    ctrl = _controller()
    ctrl.kato_ms = 1000
    ctrl.keep_alive()
    now = ctrl.last_keep_alive
    assert not ctrl.expired(now + 0.9) and ctrl.expired(now + 1.1)
    ctrl.kato_ms = 0
    assert not ctrl.expired(now + 1e6)  # KATO 0: no keep-alive


def _identify(ctrl: Controller, cns: int, nsid: int = 0, csi: int = 0) -> bytes:
    return ctrl.identify(nc.identify(1, cns, nsid, csi), _store)


def test_identify_controller() -> None:
    ctrl = _controller(in_capsule_bytes=65536, queue_depth=64)
    info = nd.IdentifyController.unpack(_identify(ctrl, nd.Cns.CONTROLLER))
    assert (info.cntlid, info.subnqn, info.maxcmd, info.nn, info.kas) == (7, SUB, 64, 2, 1)
    assert info.in_capsule_bytes == 65536 and info.icdoff == 0 and info.sgls & 0x3
    assert info.lpa & 0x2 and info.aerl == 3


def test_each_host_sees_its_namespaces() -> None:
    a, b = _controller(A), _controller(B)
    assert nd.active_namespaces(_identify(a, nd.Cns.ACTIVE_NAMESPACES)) == [1, 2]
    assert nd.active_namespaces(_identify(b, nd.Cns.ACTIVE_NAMESPACES)) == [2]
    assert nd.active_namespaces(_identify(a, nd.Cns.ACTIVE_NAMESPACES, nsid=1)) == [2]
    assert _identify(b, nd.Cns.NAMESPACE, nsid=1) == bytes(4096)  # allocated, inactive for B
    with pytest.raises(CommandFailed) as info:
        b.namespace(1)
    assert _status(info.value) == (0, 0x0B)
    with pytest.raises(CommandFailed) as info:
        _identify(a, nd.Cns.NAMESPACE, nsid=3)  # beyond NN
    assert _status(info.value) == (0, 0x0B)


def test_namespace_identify_structures() -> None:
    ctrl = _controller()
    ids = nd.descriptors(_identify(ctrl, nd.Cns.DESCRIPTORS, nsid=1))
    assert ids[nd.Nidt.CSI] == b"\x01" and len(ids[nd.Nidt.NGUID]) == 16
    other = nd.descriptors(_identify(ctrl, nd.Cns.DESCRIPTORS, nsid=2))
    assert other[nd.Nidt.NGUID] != ids[nd.Nidt.NGUID]  # unique per namespace
    kv = nd.KvNamespace.unpack(_identify(ctrl, nd.Cns.CSI_NAMESPACE, 1, nd.Csi.KV))
    assert (kv.nsze, kv.max_key, kv.max_value, kv.nguid) == (1 << 30, 16, 64 << 20, ids[2])
    shim = nd.NvmNamespaceShim.unpack(_identify(ctrl, nd.Cns.NAMESPACE, nsid=1))
    assert shim.ncap == (1 << 30) // 4096
    assert nd.NamespaceIndependent.unpack(_identify(ctrl, nd.Cns.INDEPENDENT_NAMESPACE, 1)).ready
    assert _identify(ctrl, nd.Cns.CSI_CONTROLLER, csi=nd.Csi.NVM) == bytes(4096)
    assert struct.unpack_from("<I", _identify(ctrl, nd.Cns.CSI_CONTROLLER, csi=1))[0] == 0x10300
    for cns, nsid, csi in (
        (nd.Cns.CSI_CONTROLLER, 0, nd.Csi.ZNS),
        (nd.Cns.CSI_NAMESPACE, 1, 0),
        (0x1C, 0, 0),
    ):
        with pytest.raises(CommandFailed) as info:
            _identify(ctrl, cns, nsid, csi)
        assert _status(info.value) == (0, 0x02)


def _log(
    ctrl: Controller, lid: int, length: int, csi: int = 0, offset: int = 0, sgl: int = 0
) -> bytes:
    cmd = nc.get_log_page(1, lid, min(length, 4096), csi=csi, offset=offset)
    numd = length // 4 - 1  # 0's based: up to 2**32 dwords (16 GiB), past any SGL
    cmd = replace(cmd, cdw10=lid | (numd & 0xFFFF) << 16, cdw11=numd >> 16)
    return ctrl.log_page(cmd, _store, sgl or length)


def test_log_pages() -> None:
    ctrl = _controller()
    effects = nd.EffectsLog.unpack(_log(ctrl, nd.Lid.EFFECTS, 4096, csi=nd.Csi.KV))
    assert effects.io == {0x01: 3, 0x02: 1, 0x06: 1, 0x10: 3, 0x14: 1}
    assert effects.admin[0x06] == 1 and effects.admin[0x18] == 1
    assert nd.EffectsLog.unpack(_log(ctrl, nd.Lid.EFFECTS, 4096, csi=nd.Csi.NVM)).io == {}
    smart = nd.SmartLog.unpack(_log(ctrl, nd.Lid.SMART, 512))
    assert (smart.data_units_read, smart.data_units_written, smart.power_on_hours) == (11, 15, 2)
    assert (smart.host_reads, smart.host_writes) == (3, 4)
    assert _log(ctrl, nd.Lid.SMART, 16, offset=32) == _log(ctrl, nd.Lid.SMART, 512)[32:48]
    assert _log(ctrl, nd.Lid.ERROR, 128) == bytes(128)  # zero-padded to what was asked
    with pytest.raises(CommandFailed) as info:
        _log(ctrl, 0x42, 512)
    assert _status(info.value) == (1, 0x09)
    with pytest.raises(CommandFailed):
        _log(ctrl, nd.Lid.EFFECTS, 4096, csi=nd.Csi.ZNS)


def test_log_page_builds_only_what_the_sgl_takes() -> None:
    # NUMD asks for 1 GiB (or the most it can: 16 GiB), the SGL takes 4 KiB: 4 KiB are built.
    ctrl = _controller()
    page = _log(ctrl, nd.Lid.EFFECTS, 4096, csi=nd.Csi.KV)
    for numd_bytes in (1 << 30, 1 << 34):
        got = _log(ctrl, nd.Lid.EFFECTS, numd_bytes, csi=nd.Csi.KV, sgl=4096)
        assert got == page
    assert _log(ctrl, nd.Lid.SMART, 1 << 30, sgl=600) == _log(ctrl, nd.Lid.SMART, 512) + bytes(88)
    # Zeros past a page's end only up to LOG_PAD_MAX; a read of more is Invalid Field.
    assert len(_log(ctrl, nd.Lid.ERROR, 1 << 30, sgl=64 + LOG_PAD_MAX)) == 64 + LOG_PAD_MAX
    with pytest.raises(CommandFailed) as info:
        _log(ctrl, nd.Lid.ERROR, 1 << 30, sgl=65 + LOG_PAD_MAX)
    assert _status(info.value) == (0, 0x02)
    with pytest.raises(CommandFailed) as info:
        _log(ctrl, nd.Lid.SMART, 1 << 30, sgl=1 << 30)
    assert _status(info.value) == (0, 0x02)


def test_namespace_keys() -> None:
    ctrl = _controller()
    alice, bob = ctrl.namespace(1), ctrl.namespace(2)
    key = bytes(range(16))
    assert alice.block_key(key) == key  # the SDK's block keys go in as they are
    assert alice.engine_key(key) != bob.engine_key(key)  # each namespace is its tenant's
    short = [alice.block_key(k) for k in (b"a", b"a\0", b"b")]
    assert len(set(short)) == 3 and all(len(k) == 16 for k in short)
    anonymous = build_subsystems(NvmeConfig(), Tenants([]).named)[NvmeConfig().subnqn]
    assert anonymous.namespaces[1].engine_key(key) == key


def test_who_may_connect() -> None:
    sub = _controller().subsystem
    assert sub.admits(A) and sub.admits(B) and not sub.admits("nqn.x:c")
    open_sub = build_subsystems(NvmeConfig(), Tenants([]).named)[NvmeConfig().subnqn]
    assert open_sub.admits("nqn.anyone:at-all")
    remote = build_subsystems(NvmeConfig(host="0.0.0.0"), Tenants([]).named)[NvmeConfig().subnqn]
    assert not remote.admits("nqn.anyone:at-all")  # no allow list off loopback: nobody
