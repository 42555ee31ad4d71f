"""Rank 0's rendezvous store is bound before any rank is told its port, and held (no free-port probe that another
process can take before the bind: the EADDRINUSE flake of test_ray.py::test_data_parallel_d1_d2_on_ray)."""

from __future__ import annotations

import errno
import socket

import pytest

from stalerl.training.workers.train_worker import master_store


def test_the_port_handed_to_the_other_ranks_is_already_held():
    store, init_method = master_store("127.0.0.1", 2, timeout_s=10.0)
    host, port = init_method.removeprefix("tcp://").rsplit(":", 1)
    assert host == "127.0.0.1" and int(port) == store.port > 0
    with socket.socket() as s, pytest.raises(OSError) as exc:
        s.bind(("127.0.0.1", int(port)))
    assert exc.value.errno == errno.EADDRINUSE
    store.set("k", "v")
    assert store.get("k") == b"v"
