"""A peer of an older round cannot join a newer round's connections: the peer handshake carries the
scope, and scopes name their round (no workers started: threads in this process)."""

from __future__ import annotations

import threading

import pytest

from hora.rendezvous import RendezvousClient, RendezvousServer, new_secret, round_prefix
from hora.rendezvous.auth import secret_bytes
from hora.transport.tcp_mesh import connect_mesh

pytestmark = pytest.mark.timeout(60)


def test_a_peer_dialling_with_an_older_rounds_scope_is_refused_and_the_newer_round_forms():
    secret = new_secret()
    old_scope, new_scope = round_prefix(0) + "world", round_prefix(1) + "world"
    with RendezvousServer(secret) as server:
        clients = [RendezvousClient(*server.address, secret) for _ in range(3)]
        meshes: dict[str, dict] = {}

        def member(name: str, rank: int, scope: str, client: RendezvousClient) -> None:
            meshes[name] = connect_mesh(rank, [0, 1], client, scope, secret_bytes(secret), "127.0.0.1",
                                        timeout=20.0, buffer_bytes=0, unix_sockets=False)

        listener = threading.Thread(target=member, args=("new0", 0, new_scope, clients[0]))
        listener.start()
        address = clients[2].get(new_scope + "/addr/0", timeout=20)
        clients[2].set(old_scope + "/addr/0", address)  # the stale peer dials the new round's rank 0
        member("stale1", 1, old_scope, clients[2])
        member("new1", 1, new_scope, clients[1])
        listener.join(30)
        try:
            assert not listener.is_alive()
            stale, new0, new1 = meshes["stale1"][0], meshes["new0"][1], meshes["new1"][0]
            stale.settimeout(10)
            assert stale.recv(1) == b""  # refused: closed before it could carry data
            new1.sendall(b"round 1")
            new0.settimeout(10)
            assert new0.recv(7) == b"round 1"
        finally:
            for mesh in meshes.values():
                for sock in mesh.values():
                    sock.close()
            for client in clients:
                client.close()
