"""A real libp2p host on 127.0.0.1 whose teardown fails: the error of the host's block is the one that propagates
(a node refused at start ends with its refusal), and a teardown failure after a clean block is only logged."""

from __future__ import annotations

import pytest
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey

from shoal.swarm.net import host as host_mod
from shoal.swarm.net.host import HostConfig, open_host


class Refused(Exception):
    pass


@pytest.fixture
def failing_teardown(monkeypatch):
    release = host_mod._release_sockets

    async def release_then_fail(host) -> None:
        await release(host)
        raise RuntimeError("Nursery is closed to new arrivals")  # what py-libp2p's teardown raised

    monkeypatch.setattr(host_mod, "_release_sockets", release_then_fail)


async def test_the_blocks_error_survives_a_failing_teardown(failing_teardown):
    with pytest.raises(Refused, match="at start"):
        async with open_host(Ed25519PrivateKey.generate(), HostConfig()):
            raise Refused("at start")


async def test_a_failing_teardown_after_a_clean_block_is_logged(failing_teardown, caplog):
    async with open_host(Ed25519PrivateKey.generate(), HostConfig()):
        pass
    assert "Nursery is closed to new arrivals" in caplog.text
