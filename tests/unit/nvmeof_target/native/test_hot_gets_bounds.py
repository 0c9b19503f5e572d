"""`HotGets.serve`'s flow-control arguments at their ends (found by the sanitized fuzz target
`hot-gets`): bytes in flight near 2**63 must stop it after the answer that crosses the limit,
not wrap past it; negative ones are refused."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from kvoffload import core
from kvoffload.kvstore import DramConfig, Engine, EngineConfig
from kvoffload.wire import fast
from kvoffload.wire.native.connection import Get, Hello, NativeConnection, Role
from kvoffload.wire.native.frames import FrameReader, _State

pytestmark = pytest.mark.skipif(
    core.hot_gets_type() is None, reason="the C core is not built (KVOFFLOAD_PURE_PYTHON run)"
)
KEY = bytes(range(16))
TOP = 2**63 - 1


@pytest.fixture
def engine() -> Iterator[Engine]:
    engine = Engine(EngineConfig(dram=DramConfig(capacity_bytes=1 << 20, prefault=False)))
    engine.put(KEY, b"v" * 100)
    yield engine
    engine.close()


def _serve(engine: Engine, inflight: int, max_inflight: int) -> tuple[object, FrameReader]:
    handles = engine.hot_handles()
    hot_type = core.hot_gets_type()
    assert handles is not None and hot_type is not None
    hot = hot_type(handles.lock, handles.index, handles.counters, handles.manager,
                   handles.apply_touches, handles.free, handles.arena, None, fast.frame_head,
                   _State.HEAD, handles.touch_ring)  # fmt: skip
    client = NativeConnection(Role.CLIENT)
    client.send(Hello(1 << 30))
    reader = FrameReader()
    reader.receive_data(b"".join(client.send(Get(rid, KEY)) for rid in (1, 2, 3)))
    got = hot.serve(reader, inflight, max_inflight, 9)
    if got is not None:
        hot.release(got[1], got[2])
    return got, reader


def test_bytes_in_flight_near_the_top_stop_after_one_answer(engine: Engine) -> None:
    got, reader = _serve(engine, TOP - 1, TOP)
    assert got is not None and got[3] == (1, 0, 0, 0)  # type: ignore[index]
    assert engine.stats().as_dict()["gets"] == 1 and not reader.at_boundary


@pytest.mark.parametrize(("inflight", "max_inflight"), [(-1, 1 << 30), (0, -1)])
def test_negative_flow_control_is_refused(engine: Engine, inflight: int, max_inflight: int) -> None:
    with pytest.raises(ValueError, match="negative"):
        _serve(engine, inflight, max_inflight)
    assert engine.stats().as_dict()["gets"] == 0
