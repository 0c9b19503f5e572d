"""The daemon's handler tables cover what its codecs admit: every native request, every
Fabrics, Admin and Key Value command the NVMe front implements."""

from __future__ import annotations

from kvoffload.nvmeof_target.native.requests import HANDLERS
from kvoffload.nvmeof_target.nvme.admin import ADMIN, ADMIN_FABRICS, FABRICS
from kvoffload.nvmeof_target.nvme.io import IO
from kvoffload.wire.native.events import _ANSWER
from kvoffload.wire.nvme_tcp.cmd import AdminOpc, FabricsType, KvOpc


def test_every_native_request_has_a_handler() -> None:
    assert set(HANDLERS) == set(_ANSWER)


def test_every_nvme_command_has_a_handler() -> None:
    assert set(ADMIN) == set(AdminOpc)
    assert set(IO) == set(KvOpc)
    # Authentication is not offered: AUTH_SEND/AUTH_RECEIVE are Invalid Opcode.
    assert set(FABRICS) == set(FabricsType) - {FabricsType.AUTH_SEND, FabricsType.AUTH_RECEIVE}
    assert ADMIN_FABRICS.issubset(FABRICS)
