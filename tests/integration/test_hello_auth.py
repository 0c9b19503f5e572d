"""Challenge–response at Hello against live daemons: what a node (or an eavesdropper) learns at
Hello cannot be replayed on another connection or to another node; a node configured with
only its derived key admits the tenant's clients; wrong secrets and other tenants' names are
refused; the token itself travels only where explicitly allowed."""

from __future__ import annotations

import asyncio
import socket
import ssl
import subprocess
import sys
import threading
from collections.abc import Callable, Iterator
from functools import partial
from pathlib import Path
from typing import Any

import pytest

from kvoffload.client_sdk import AsyncClient, Client
from kvoffload.errors import AuthError
from kvoffload.wire.hello_auth import (
    client_proof,
    new_nonce,
    node_key,
    server_proof,
    tls_binding,
    tls_binding_of_pem,
)
from kvoffload.wire.native.connection import (
    NEED_DATA,
    Auth,
    Challenge,
    ConnectionClosed,
    ErrorReply,
    Event,
    Hello,
    NativeConnection,
    Role,
    Welcome,
)
from kvoffload.wire.status import Status
from tests.integration.test_daemon import _self_signed

pytestmark = [pytest.mark.integration, pytest.mark.timeout(120)]
Start = Callable[..., Any]

ALICE, BOB = "alice-secret-0123456789", "bob-secret-9876543210"


def _tenants(node: str, **keys: str) -> str:
    """A config: node id `node`; each tenant with its secret, or (key=...) only its node key."""
    lines = [f'[cluster]\nnode_id = "{node}"\n']
    for name, value in keys.items():
        field = "node_key" if len(value) == 64 and "secret" not in value else "token"
        lines.append(f'[tenants.{name}]\n{field} = "{value}"\n')
    return "".join(lines)


class Raw:
    """One hand-driven native connection: send an event, take the next answer."""

    def __init__(self, port: int, tls: ssl.SSLContext | None = None) -> None:
        self.sock = socket.create_connection(("127.0.0.1", port), timeout=10)
        if tls is not None:
            self.sock = tls.wrap_socket(self.sock, server_hostname="localhost")
        self.conn = NativeConnection(Role.CLIENT)
        self.rid = 0

    def ask(self, make: Callable[[int], Event]) -> Event | ConnectionClosed:
        self.rid += 1
        self.sock.sendall(self.conn.send(make(self.rid)))
        while True:
            event = self.conn.next_event()
            if event is not NEED_DATA:
                assert isinstance(event, (Event, ConnectionClosed))
                return event
            data = self.sock.recv(65536)
            self.conn.receive_data(data)

    def close(self) -> None:
        self.sock.close()


@pytest.fixture
def raw() -> Iterator[Callable[[int], Raw]]:
    opened: list[Raw] = []

    def open_(port: int) -> Raw:
        opened.append(Raw(port))
        return opened[-1]

    yield open_
    for r in opened:
        r.close()


def _challenge(r: Raw, tenant: str = "", nonce: bytes | None = None) -> tuple[bytes, Challenge]:
    nonce = nonce or new_nonce()
    answer = r.ask(lambda rid: Hello(rid, tenant=tenant, nonce=nonce))
    assert isinstance(answer, Challenge), answer
    return nonce, answer


def _refused(answer: object) -> bool:
    return isinstance(answer, ErrorReply) and answer.status == Status.AUTH


def test_a_captured_hello_answer_fails_on_a_new_connection(
    start_daemon: Start, raw: Callable[[int], Raw]
) -> None:
    daemon = start_daemon(config=_tenants("n1", alice=ALICE))
    first = raw(daemon.port)
    nonce, challenge = _challenge(first)
    assert challenge.node == "n1"
    key = node_key(ALICE, "n1")
    proof = client_proof(key, "", "n1", nonce, challenge.nonce)
    welcome = first.ask(lambda rid: Auth(rid, proof))
    assert isinstance(welcome, Welcome) and welcome.tenant == "alice"
    assert welcome.proof == server_proof(key, "alice", "n1", nonce, challenge.nonce)
    # An eavesdropper replays the whole exchange (same client nonce, same proof) on a new
    # connection: the node's nonce is new, so the proof no longer fits.
    replay = raw(daemon.port)
    _, fresh = _challenge(replay, nonce=nonce)
    assert fresh.nonce != challenge.nonce
    assert _refused(replay.ask(lambda rid: Auth(rid, proof)))


def test_what_one_node_learns_does_not_authenticate_to_another(
    start_daemon: Start, raw: Callable[[int], Raw]
) -> None:
    rogue_key = node_key(ALICE, "n1")  # all that node n1 holds for alice
    n2 = start_daemon(config=_tenants("n2", alice=ALICE))
    # n1 relays the answer it got from a client for its own challenge...
    at_n1, n1_nonce = new_nonce(), new_nonce()
    captured = client_proof(rogue_key, "", "n1", at_n1, n1_nonce)
    r = raw(n2.port)
    _challenge(r, nonce=at_n1)
    assert _refused(r.ask(lambda rid: Auth(rid, captured)))
    # ...or answers n2's challenge itself with its own key, even claiming to be n2 in the
    # proof: its key is not n2's.
    r = raw(n2.port)
    nonce, challenge = _challenge(r)
    forged = client_proof(rogue_key, "", challenge.node, nonce, challenge.nonce)
    assert _refused(r.ask(lambda rid: Auth(rid, forged)))
    # The real client (who holds the secret) gets in.
    with Client.connect(n2.url(token=ALICE)) as alice:
        alice.put(bytes(16), b"x")
        assert alice.get(bytes(16)) is not None


def test_a_node_configured_with_only_its_derived_key_admits_the_client(
    start_daemon: Start,
) -> None:
    derived = subprocess.run(
        [sys.executable, "-m", "kvoffload.cli", "node-key", "--node", "n7"],
        input=ALICE + "\n",
        capture_output=True,
        text=True,
        check=True,
    ).stdout.strip()
    assert derived == node_key(ALICE, "n7").hex() and ALICE not in derived
    daemon = start_daemon(config=_tenants("n7", alice=derived, bob=BOB))
    with (
        Client.connect(daemon.url(token=ALICE)) as alice,
        Client.connect(daemon.url(token=BOB)) as bob,
    ):
        alice.put(bytes(16), b"alice's")
        assert alice.get(bytes(16)) is not None and bob.get(bytes(16)) is None
        assert alice.stats().store["server"]["tenant"] == "alice"  # type: ignore[index]
    # The same key configured under another node id admits nobody: it is n7's alone.
    other = start_daemon(config=_tenants("n8", alice=derived))
    with pytest.raises(AuthError):
        Client.connect(other.url(token=ALICE, retries="0")).stats()


def test_a_wrong_secret_is_refused(start_daemon: Start) -> None:
    daemon = start_daemon(config=_tenants("n1", alice=ALICE))
    for token in ("wrong", ALICE + "x"):
        with pytest.raises(AuthError, match="invalid credentials"):
            Client.connect(daemon.url(token=token, retries="0")).stats()


def test_a_tenant_cannot_authenticate_as_another(start_daemon: Start) -> None:
    daemon = start_daemon(config=_tenants("n1", alice=ALICE, bob=BOB))
    with pytest.raises(AuthError):
        Client.connect(daemon.url(token=ALICE, tenant="bob", retries="0")).stats()
    # An unknown name is refused the same way (names are not revealed).
    with pytest.raises(AuthError, match="invalid credentials"):
        Client.connect(daemon.url(token=ALICE, tenant="carol", retries="0")).stats()
    with Client.connect(daemon.url(token=ALICE, tenant="alice")) as alice:
        assert alice.stats().store["server"]["tenant"] == "alice"  # type: ignore[index]
    with Client.connect(daemon.url(token=BOB)) as bob:  # found by its proof
        assert bob.stats().store["server"]["tenant"] == "bob"  # type: ignore[index]


def test_the_token_hello_is_refused_unless_turned_on(
    start_daemon: Start, raw: Callable[[int], Raw]
) -> None:
    strict = start_daemon(config=_tenants("n1", alice=ALICE))
    answer = raw(strict.port).ask(lambda rid: Hello(rid, version=4, token=ALICE))
    assert _refused(answer) and "token_hello" in answer.message  # type: ignore[union-attr]
    compat = start_daemon(config=_tenants("n1", alice=ALICE) + "[native]\ntoken_hello = true\n")
    answer = raw(compat.port).ask(lambda rid: Hello(rid, version=4, token=ALICE))
    assert isinstance(answer, Welcome) and answer.tenant == "alice"


class OldNode:
    """A node that speaks only protocol 4 (or a rogue one that claims to): it records the
    tokens Hellos bring it and welcomes them."""

    def __init__(self, challenge: Challenge | None = None) -> None:
        self.listener = socket.create_server(("127.0.0.1", 0))
        self.port = self.listener.getsockname()[1]
        self.tokens: list[str] = []
        self.challenge = challenge  # answer Hellos with a nonce with this, then a proofless Welcome
        threading.Thread(target=self._serve, daemon=True).start()

    def _serve(self) -> None:
        while True:
            try:
                sock, _ = self.listener.accept()
            except OSError:
                return
            with sock:
                self._one(sock)

    def _one(self, sock: socket.socket) -> None:
        conn = NativeConnection(Role.SERVER)
        while data := sock.recv(65536):
            conn.receive_data(data)
            while (event := conn.next_event()) is not NEED_DATA:
                if isinstance(event, Hello) and event.nonce is not None and self.challenge:
                    sock.sendall(conn.send(Challenge(event.request_id, *self._node())))
                elif isinstance(event, Hello) and event.version > 4:
                    error = ErrorReply(
                        event.request_id, Status.PROTOCOL, "protocol version 5 is not supported"
                    )
                    sock.sendall(conn.send(error))
                    return
                elif isinstance(event, (Hello, Auth)):
                    if isinstance(event, Hello):
                        self.tokens.append(event.token)
                    welcome = Welcome(event.request_id, 4, "alice", 1 << 20, 1 << 20)
                    sock.sendall(conn.send(welcome))
                else:
                    return

    def _node(self) -> tuple[str, bytes]:
        assert self.challenge is not None
        return self.challenge.node, self.challenge.nonce

    def close(self) -> None:
        self.listener.close()


def test_the_client_sends_its_token_only_with_legacy_token() -> None:
    old = OldNode()
    try:
        url = f"kv://127.0.0.1:{old.port}?token={ALICE}&retries=0"
        with pytest.raises(AuthError, match="legacy_token=1"):
            Client.connect(url).stats()
        assert old.tokens == []
        with Client.connect(url + "&legacy_token=1") as client:
            client.exists(bytes(16))
        assert old.tokens and set(old.tokens) == {ALICE}
    finally:
        old.close()


def test_a_node_that_cannot_prove_its_key_is_refused(start_daemon: Start) -> None:
    rogue = OldNode(Challenge(1, "n1", new_nonce()))
    try:
        url = f"kv://127.0.0.1:{rogue.port}?token={ALICE}&retries=0"
        with pytest.raises(AuthError, match="could not prove"):
            Client.connect(url).stats()
        with pytest.raises(AuthError, match="not 'n2'"):
            Client.connect(url + "&node=n2").stats()
        assert rogue.tokens == []
    finally:
        rogue.close()
    daemon = start_daemon(config=_tenants("n1", alice=ALICE))
    with Client.connect(daemon.url(token=ALICE, node="n1")) as alice:
        assert alice.stats().store["server"]["tenant"] == "alice"  # type: ignore[index]


def test_the_async_client_proves_its_secret_too(start_daemon: Start) -> None:
    daemon = start_daemon(config=_tenants("n1", alice=ALICE))

    async def main() -> bytes | None:
        async with AsyncClient.connect(daemon.url(token=ALICE, tenant="alice")) as alice:
            await alice.put(bytes(16), b"async")
            return await alice.get(bytes(16))

    assert asyncio.run(main()) == b"async"

    async def wrong() -> None:
        async with AsyncClient.connect(daemon.url(token="wrong", retries="0")) as client:
            await client.stats()

    with pytest.raises(AuthError, match="invalid credentials"):
        asyncio.run(wrong())


def test_over_tls_the_proof_is_bound_to_the_nodes_certificate(
    start_daemon: Start, tmp_path: Path
) -> None:
    cert, key = _self_signed(tmp_path)
    daemon = start_daemon(
        "--tls-cert", str(cert), "--tls-key", str(key), config=_tenants("n1", alice=ALICE)
    )
    params = {"tls": "1", "ca": str(cert), "server_name": "localhost", "token": ALICE}
    with Client.connect(daemon.url(**params)) as alice:
        alice.put(bytes(16), b"over tls")
        assert alice.get(bytes(16)) == b"over tls"

    async def main() -> bytes | None:
        async with AsyncClient.connect(daemon.url(**params)) as client:
            return await client.get(bytes(16))

    assert asyncio.run(main()) == b"over tls"
    # A proof made for another endpoint (what a relay that terminates TLS itself, or a plain
    # connection, would hand on) fails; the one for this certificate passes.
    others = (b"", tls_binding(b"another certificate"))
    for bound in (*others, tls_binding_of_pem(cert.read_text())):
        r = Raw(daemon.port, ssl.create_default_context(cafile=str(cert)))
        try:
            nonce, challenge = _challenge(r)
            proof = client_proof(node_key(ALICE, "n1"), "", "n1", nonce, challenge.nonce, bound)
            answer = r.ask(partial(Auth, proof=proof))
            assert _refused(answer) if bound in others else isinstance(answer, Welcome), answer
        finally:
            r.close()
