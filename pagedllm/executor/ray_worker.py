"""The Ray actor that hosts one worker rank (``RayExecutor``).

The actor is only the rank's process, placed by Ray: the rank itself runs ``serve_rank``
(``mp_worker.py``) on a thread of the actor, over a TCP ``multiprocessing.connection`` that the
driver opens to the address the actor listens on (authenticated with the executor's random key).
Every call of the executor, start-up and per-step alike, then travels over that connection, so no
Ray task runs per step. When the rank ends (shutdown, an error, the driver's connection closing)
the actor's process exits; the driver also kills the actor.
"""

from __future__ import annotations

import os
import socket
import threading
from multiprocessing.connection import Listener

from pagedllm.config import EngineConfig
from pagedllm.executor.mp_worker import serve_rank


class RayWorker:
    """One rank's process. Invariant: ``listen`` is called before ``start``, each once."""

    def __init__(self) -> None:
        self._listener: Listener | None = None

    def pid(self) -> int:
        return os.getpid()

    def listen(self, authkey: bytes) -> tuple[str, int]:
        """Listen for the driver's connection on this node's address; returns that address."""
        import ray

        self._listener = Listener((ray.util.get_node_ip_address(), 0), authkey=authkey)
        return self._listener.address

    def rendezvous_address(self) -> str:
        """A ``tcp://`` address on this node, with a free port, for the ``torch.distributed`` store
        (rank 0 serves it)."""
        import ray

        ip = ray.util.get_node_ip_address()
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
            s.bind((ip, 0))
            port = s.getsockname()[1]
        return f"tcp://{ip}:{port}"

    def start(self, config: EngineConfig, rank: int, init_method: str) -> None:
        """Serve rank ``rank`` on a thread once the driver has connected; returns at once. The
        actor sees only its own GPU (Ray sets ``CUDA_VISIBLE_DEVICES``): device index 0."""
        listener = self._listener
        if listener is None:
            raise RuntimeError("RayWorker.start before listen")

        def run() -> None:
            conn = listener.accept()
            listener.close()
            serve_rank(config, rank, init_method, conn, device_index=0)

        threading.Thread(target=run, name=f"pagedllm-rank-{rank}", daemon=True).start()
