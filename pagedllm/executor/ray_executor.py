"""RayExecutor: one Ray actor per rank, placed by a placement group; the scheduler stays here.

Ray only places and hosts the ranks: a placement group of one bundle per rank (``{"GPU": 1}`` on
CUDA, ``{"CPU": 1}`` on the CPU, packed onto as few nodes as fit), one ``RayWorker`` actor in each
bundle. The ranks join one ``torch.distributed`` world (NCCL / gloo) through a TCP store on rank 0's
node. The calls travel as in the multiprocess executor (``conn_executor.py``), over one TCP
``multiprocessing.connection`` per rank that the driver opens to its actor: a step costs a pickle
and a socket write per rank, not a Ray task (``benchmarks/ray_broadcast.py`` compares the two).

Cluster: a process that has already called ``ray.init`` keeps its cluster; else ``RAY_ADDRESS``
(``ray start --head`` prints it, ``auto`` finds a local one) joins an existing cluster; else a
local Ray instance is started, sized for the ranks, without a dashboard. Only a connection this
executor made is closed (``ray.shutdown``) when it shuts down.

Failure: a rank that raises sends its traceback; an actor that dies closes its connection, and
Ray's account of its death (``ray.get`` on the actor) is the cause in the ``WorkerFailedError``.
Shutdown (explicit, garbage collection, interpreter exit) asks the ranks to stop, waits a grace
period, then kills every actor and removes the placement group: no orphans.
"""

from __future__ import annotations

import logging
import secrets
import time
import weakref
from multiprocessing.connection import Client, Connection
from typing import Any

from pagedllm import envs
from pagedllm.config import EngineConfig
from pagedllm.executor.conn_executor import ConnectionExecutor, send_shutdown

logger = logging.getLogger("pagedllm")

_PLACEMENT_TIMEOUT_S = 120.0  # resources the cluster has may be held by others for a while
_START_TIMEOUT_S = 120.0  # actors' processes to start (a fresh node imports torch)
_STOP_GRACE_S = 5.0


class RayExecutor(ConnectionExecutor):
    """Drives ``world_size`` Ray actors (module doc).

    Invariant: ``actors[r]``, ``conns[r]`` and ``pids[r]`` belong to rank ``r``; ``actors`` live in
    bundle ``r`` of ``placement_group``. Cost per step: that of ``ConnectionExecutor``.
    """

    def __init__(self, config: EngineConfig) -> None:
        super().__init__(config)
        import ray

        self._owns_ray = connect_ray(self.world_size, on_gpu=config.device.startswith("cuda"))
        self.actors: list[Any] = []
        self.pids: list[int] = []
        self.placement_group = None
        state = _ActorsState(self.conns, self.actors, self._owns_ray)
        self._finalizer = weakref.finalize(self, _stop_actors, state)
        try:
            self.placement_group = state.placement_group = _place(ray, config, self.world_size)
            self._start_actors(ray, config)
        except BaseException:
            self.shutdown()
            raise
        self._replies(range(self.world_size))  # every rank built its model (or the failure is raised)

    def _start_actors(self, ray: Any, config: EngineConfig) -> None:
        from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

        from pagedllm.executor.ray_worker import RayWorker

        on_gpu = config.device.startswith("cuda")
        actor_class = ray.remote(RayWorker)
        for rank in range(self.world_size):
            strategy = PlacementGroupSchedulingStrategy(self.placement_group, placement_group_bundle_index=rank)
            self.actors.append(actor_class.options(num_cpus=0 if on_gpu else 1, num_gpus=1 if on_gpu else 0,
                                                   scheduling_strategy=strategy).remote())
        authkey = secrets.token_bytes(32)
        addresses = ray.get([a.listen.remote(authkey) for a in self.actors], timeout=_START_TIMEOUT_S)
        self.pids = ray.get([a.pid.remote() for a in self.actors], timeout=_START_TIMEOUT_S)
        init_method = ray.get(self.actors[0].rendezvous_address.remote(), timeout=_START_TIMEOUT_S)
        ray.get([a.start.remote(config, rank, init_method) for rank, a in enumerate(self.actors)],
                timeout=_START_TIMEOUT_S)
        for address in addresses:
            self.conns.append(Client(tuple(address), authkey=authkey))

    def _describe(self, rank: int) -> str:
        pid = self.pids[rank] if rank < len(self.pids) else "?"
        return f"Ray actor, pid {pid}"

    def _exit_cause(self, rank: int) -> str:
        import ray

        try:
            ray.get(self.actors[rank].pid.remote(), timeout=5.0)
        except ray.exceptions.RayActorError as e:
            return f"the actor died: {_first_lines(str(e))}"
        except Exception as e:  # noqa: BLE001 - the cause is only reported
            return f"a closed connection (Ray: {type(e).__name__})"
        return "a closed connection (the actor is still running)"

    def _kill_all(self) -> None:
        _kill_actors(self.actors)

    def shutdown(self) -> None:
        self._finalizer()


def connect_ray(world_size: int, on_gpu: bool) -> bool:
    """Make this process a Ray driver (module doc); True when it connected here (and so must
    disconnect), False when ``ray.init`` had already been called."""
    import ray

    if ray.is_initialized():
        return False
    quiet = dict(logging_level=logging.WARNING, log_to_driver=True)
    address = envs.RAY_ADDRESS
    if address:
        ray.init(address=address, **quiet)
    else:  # on the CPU each rank's bundle is one logical CPU; on CUDA Ray counts the GPUs
        ray.init(num_cpus=None if on_gpu else world_size, include_dashboard=False, **quiet)
    return True


def _place(ray: Any, config: EngineConfig, world_size: int) -> Any:
    """A ready placement group of ``world_size`` one-device bundles, or a ``ValueError`` saying
    what the cluster lacks."""
    from ray.util.placement_group import placement_group

    resource = "GPU" if config.device.startswith("cuda") else "CPU"
    total = ray.cluster_resources().get(resource, 0)
    if total < world_size:
        raise ValueError(f"distributed_executor_backend='ray': tensor_parallel_size x pipeline_parallel_size "
                         f"({world_size}) needs {world_size} {resource}s, the Ray cluster has {total:g}")
    group = placement_group([{resource: 1} for _ in range(world_size)], strategy="PACK")
    try:
        ray.get(group.ready(), timeout=_PLACEMENT_TIMEOUT_S)
    except ray.exceptions.GetTimeoutError:
        ray.util.remove_placement_group(group)
        raise RuntimeError(f"distributed_executor_backend='ray': {world_size} bundles of {{{resource!r}: 1}} "
                           f"could not be placed in {_PLACEMENT_TIMEOUT_S:.0f} s (are they held by other "
                           "jobs?)") from None
    return group


class _ActorsState:
    """What the finalizer stops: the lists are filled in place as the executor starts."""

    def __init__(self, conns: list[Connection], actors: list[Any], owns_ray: bool) -> None:
        self.conns = conns
        self.actors = actors
        self.owns_ray = owns_ray
        self.placement_group = None


def _stop_actors(state: _ActorsState) -> None:
    """Ask every rank to stop, wait a grace period for their connections to close, then kill the
    actors, remove the placement group, and disconnect from Ray if this executor connected."""
    send_shutdown(state.conns)
    deadline = time.monotonic() + _STOP_GRACE_S
    for conn in state.conns:
        try:
            while conn.poll(max(0.0, deadline - time.monotonic())):
                conn.recv_bytes()  # a late reply, or EOFError once the rank has exited
        except (EOFError, OSError):
            pass
        conn.close()
    try:
        import ray

        if not ray.is_initialized():
            return
        _kill_actors(state.actors)
        if state.placement_group is not None:
            ray.util.remove_placement_group(state.placement_group)
        if state.owns_ray:
            ray.shutdown()
    except Exception:  # noqa: BLE001 - at interpreter exit Ray may be half torn down already
        logger.debug("Ray clean-up failed", exc_info=True)


def _kill_actors(actors: list[Any]) -> None:
    import ray

    for actor in actors:
        try:
            ray.kill(actor, no_restart=True)
        except Exception:  # noqa: BLE001 - already dead or Ray gone: nothing left to stop
            pass


def _first_lines(text: str, limit: int = 3) -> str:
    return " ".join(line.strip() for line in text.strip().splitlines()[:limit])
