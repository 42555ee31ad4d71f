"""Rendezvous ports for the multi-process tests, without the free-port race.

A free-port probe (bind port 0, read the port, close the socket, start torch.distributed on that port later) races
with every other process on the machine: one can take the port in between, and the rendezvous fails with EADDRINUSE
(CI runs other suites beside these). Instead the port is bound once, by a port-0 bind, and held until the run ends:

- ``held_store()``: the test process hosts the ranks' TCPStore on a port the OS picks and keeps it for the run; the
  ranks join it as clients, so none of them binds the port. A rank that calls ``init_process_group`` itself joins
  with ``dist.TCPStore(host, port, is_master=False)`` and ``init_process_group(store=...)``; where a framework makes
  that call (env:// or tcp://), ``AGENT_STORE_ENV`` in the rank's environment makes torch connect every rank as a
  client, as it does under torchrun's agent (the test process plays the agent).
- ``TORCHRUN_STANDALONE`` (argv) / ``TORCHRUN_STANDALONE_ENV`` (environment, for a framework that runs torchrun
  itself): torchrun's standalone rendezvous, whose agent creates its stores on port 0 and holds them; with the
  torch these lanes pin, the workers' MASTER_PORT is the agent's held store. Loopback, like the tests' own stores.
- One rank alone (world size 1) needs no known port: ``MASTER_PORT=0`` lets its own store bind a free one.
"""

from __future__ import annotations

import datetime
from typing import Any

LOOPBACK = "127.0.0.1"

TORCHRUN_STANDALONE = ["--standalone", "--local-addr", LOOPBACK]
TORCHRUN_STANDALONE_ENV = {"PET_STANDALONE": "1", "PET_LOCAL_ADDR": LOOPBACK}

# torch.distributed.rendezvous: every rank's env:// / tcp:// store is a client of a store someone else hosts
AGENT_STORE_ENV = {"TORCHELASTIC_USE_AGENT_STORE": "True"}


def held_store(host: str = LOOPBACK, timeout_s: float = 300.0) -> Any:
    """A TCPStore server on a port the OS picks (``.port``), listening from now on. Keep a reference until the
    ranks are done: the server stops when the object is freed."""
    import torch.distributed as dist

    return dist.TCPStore(host, 0, is_master=True, wait_for_workers=False,
                         timeout=datetime.timedelta(seconds=timeout_s))
