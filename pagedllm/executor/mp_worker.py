"""The body of one worker rank: join the world, build a ``Worker``, then serve the driver's calls
from a connection until told to stop, the connection closes or the driver dies. A spawned process
of the multiprocess executor runs it as its main (``worker_main``); a Ray actor runs it on a thread
(``ray_worker.py``); both through ``serve_rank``.

Messages from the driver are pickled ``(method, args)`` tuples (``execute_model``'s argument in
the wire form of ``step_codec.py``). Replies are ``("ok", value)`` or
``("error", rank, traceback)``; after an error the process exits (its peers may be stuck in a
collective it will never join, so the driver tears the whole world down). Which calls reply:

- start-up calls (``determine_num_blocks``, ``bytes_per_block``, ``initialize_kv_cache``,
  ``warm_up``, and the implicit ``ready`` after the model is built): every rank;
- ``execute_model``: none (the step's forward is launched; a failure is reported with the step's
  sample reply, or by the error message the driver finds while it waits);
- ``sample_tokens``: only the output rank, with the step's ``ModelRunnerOutput``. Every rank calls
  ``result()`` on its own step handle, which applies the sampled tokens to its ``InputBatch`` (the
  ranks sample the same tokens from the same gathered logits with the same seeds); with async
  scheduling it does so once the next step's forward is launched (``_serve``), or on ``flush``
  (the driver waits for that step with nothing else to launch: pipeline micro-batches). Only the
  last pipeline stage samples; the earlier stages' steps resolve to nothing.
"""

from __future__ import annotations

import dataclasses
import os
import sys
import threading
import time
import traceback
from multiprocessing.connection import Connection
from typing import Any

from pagedllm.config import EngineConfig
from pagedllm.executor.step_codec import decode_scheduler_output

# Start-up and per-step calls a worker serves (the executor's interface, by name).
WORKER_CALLS = ("determine_num_blocks", "bytes_per_block", "initialize_kv_cache", "warm_up", "execute_model",
                "sample_tokens")


def _exit_with_parent(parent_pid: int, period_s: float = 0.5) -> None:
    """Exit this process when the driver is gone (its pid is no longer our parent): a driver killed
    without running its shutdown must not leave workers behind, even ones stuck in a collective."""

    def watch() -> None:
        while os.getppid() == parent_pid:
            time.sleep(period_s)
        os._exit(1)

    threading.Thread(target=watch, name="pagedllm-parent-watch", daemon=True).start()


def first_device_index(config: EngineConfig) -> int:
    """The GPU index of rank 0 on this host: ``K`` of ``cuda:K`` (a data-parallel replica's first
    GPU), else 0."""
    _, _, index = config.device.partition(":")
    return int(index) if index else 0


def _rank_config(config: EngineConfig, device_index: int) -> EngineConfig:
    """The config a rank runs with: on CUDA, device ``cuda:device_index`` (one GPU per rank)."""
    if not config.device.startswith("cuda"):
        return config
    return dataclasses.replace(config, device=f"cuda:{device_index}")


def _build_worker(config: EngineConfig, rank: int, init_method: str, device_index: int) -> Any:
    import torch

    from pagedllm.cpu_threads import intra_op_threads
    from pagedllm.distributed import init_distributed
    from pagedllm.worker.worker import Worker

    pc = config.parallel_config
    config = _rank_config(config, device_index)
    if config.device.startswith("cuda"):
        torch.cuda.set_device(torch.device(config.device))
        backend = "nccl"
    else:  # the ranks share the host's CPUs
        torch.set_num_threads(max(1, intra_op_threads(for_server=False) // pc.world_size))
        backend = "gloo"
    dtype = getattr(torch, config.model_config.dtype)
    init_distributed(rank, pc.world_size, pc.tensor_parallel_size, init_method, backend, dtype,
                     pc.enable_expert_parallel)
    return Worker(config)


def _serve(worker: Any, rank: int, is_output_rank: bool, conn: Connection, defer_results: bool) -> None:
    """Answer the driver's calls until ``shutdown`` or a closed pipe; raise on a failed call.

    With ``defer_results`` (async scheduling) a sampled step's result is resolved only after the
    next step's forward has been launched, the order the single-process engine core uses: the
    driver always sends ``execute_model(N+1)`` before it waits for step N's output, so this rank's
    input preparation for N+1 overlaps the GPU's work on N instead of waiting for it."""
    pending = None  # the handle of the last sampled step, not yet resolved

    def resolve() -> None:
        nonlocal pending
        output, pending = pending.result(), None
        if is_output_rank:
            conn.send(("ok", output))

    while True:
        try:
            method, args = conn.recv()
        except EOFError:  # the driver is gone
            return
        if method == "shutdown":
            return
        if method == "flush":
            if pending is not None:
                resolve()
            continue
        if method not in WORKER_CALLS:
            raise ValueError(f"unknown worker call {method!r}")
        if method == "execute_model":
            worker.execute_model(decode_scheduler_output(*args))
            if pending is not None:
                resolve()
            continue
        if pending is not None:
            resolve()
        result = getattr(worker, method)(*args)
        if method == "sample_tokens":
            pending = result
            if not defer_results:
                resolve()
            continue
        conn.send(("ok", result))


def worker_main(config: EngineConfig, rank: int, init_method: str, conn: Connection, parent_pid: int) -> None:
    """Entry point of worker process ``rank`` (spawned by ``MultiprocExecutor``): rank ``r`` of a
    replica whose first GPU is ``cuda:K`` takes ``cuda:K+r``."""
    _exit_with_parent(parent_pid)
    serve_rank(config, rank, init_method, conn, first_device_index(config) + rank)


def serve_rank(config: EngineConfig, rank: int, init_method: str, conn: Connection, device_index: int) -> None:
    """Build rank ``rank``'s worker (on GPU ``device_index`` on CUDA), reply ``ready``, serve the
    driver's calls, then end the process itself once its resources are released: the interpreter's
    own teardown of torch and the model takes seconds and frees nothing the exit does not."""
    worker = None
    exit_code = 0
    try:
        worker = _build_worker(config, rank, init_method, device_index)
        conn.send(("ok", None))
        _serve(worker, rank, rank == config.parallel_config.output_rank, conn, config.async_scheduling)
    except BaseException:  # noqa: BLE001 - every failure goes to the driver, with its traceback
        exit_code = 1
        try:
            conn.send(("error", rank, traceback.format_exc()))
        except (OSError, EOFError):
            pass
    finally:
        from pagedllm.distributed import destroy_distributed

        if worker is not None:
            worker.shutdown()
        destroy_distributed()
        conn.close()
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(exit_code)
