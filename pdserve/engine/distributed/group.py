"""A tensor-parallel worker's ranks, as rank 0 holds them: start, step, watch, stop.

A worker with ``tensor_parallel_size`` N is N processes on one host. Rank 0 is the worker: it
alone speaks gRPC, schedules, samples and moves KV. It starts the other N - 1 ranks
(``python -m pdserve.engine.distributed.follower``) as its own child processes, and they follow its
steps: each step, rank 0 broadcasts the prepared inputs (``pdserve.engine.distributed.step``) and every
rank runs the forward on its share, the all-reduces inside the model keeping them in step, then
computes its vocabulary slice of each logits rank 0 computes, gathered to rank 0.

The ranks meet through a ``FileStore`` in a private temporary directory, and talk over gloo
on loopback (NCCL on CUDA, rank r on device r of those the process sees; gloo over the CUDA
tensors where there are fewer devices than ranks): nothing listens beyond the host. On CPU
every rank's KV cache is a part of one shared-memory file that rank 0 made
(``kv_cache.shared_caches``); on CUDA each rank allocates its own on its device.

Each other rank also gets one end of a socket pair (``FollowerSpec.service_fd``), rank 0
keeping the other (``RankGroup.service_sockets``), for what a layer above runs in that rank's
process next to its steps: ``entry`` names the module each rank runs (``follower.main`` with
its services; the worker's is ``pdserve.shell.rank_follower``, which serves the rank's
KV-transfer agent, created there over the rank's own cache).

Failure is the worker's as a whole: a rank that exits (its process watched by a thread here)
or a collective that fails (``lost``, from the model runner) calls ``on_lost``, which by
default ends rank 0's process at once: to the router and the supervisor it is a dead worker,
whose streams migrate and whose slot gets a new worker. The other ranks leave when rank 0 does
(their stdin, a pipe from rank 0, closes). A rank that hangs holds rank 0 in its collective:
the router's hang detection then replaces the worker.
"""

from __future__ import annotations

import dataclasses
import datetime
import json
import logging
import os
import shutil
import socket
import subprocess
import tempfile
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import torch

from pdserve.engine.distributed import memory_share, step as tp_step
from pdserve.engine.distributed.processes import kill as _kill, spawn as _spawn, wait_for as _wait_for
from pdserve.engine.config import DTYPES, MIXED, EngineConfig, ModelConfig
from pdserve.engine.errors import InvalidRequestError, RankLost
from pdserve.engine.attention.kv_cache import cache_spec_of, num_cache_blocks, prefault, shared_caches
from pdserve.engine.loader import load_model, materialize, read_model_config
from pdserve.engine.models.registry import check_split
from pdserve.engine.models.decoder import CausalLM
from pdserve.engine.parallel import TensorParallel

log = logging.getLogger(__name__)

# Collectives never time out on their own: a rank that waits for the next step waits as long
# as the worker is idle. A rank that is stuck is the router's to find (its hang timeout).
COLLECTIVE_TIMEOUT = datetime.timedelta(days=365)
FOLLOWER_ENTRY = "pdserve.engine.distributed.follower"  # the module a rank runs: the steps alone
EXIT_RANK_LOST = 70  # rank 0's exit status when its worker lost a rank (EX_SOFTWARE)


@dataclass(frozen=True)
class FollowerSpec:
    """Everything a rank other than 0 needs to start, as plain values (its one argument, JSON)."""

    rank: int
    size: int
    store: str  # the FileStore's path
    model_dir: str
    dtype: str  # a key of engine.config.DTYPES
    device: str
    attention_backend: str
    block_size: int
    num_blocks: int
    cache_fd: int  # the shared cache file (CPU), inherited; -1: the rank allocates its own (CUDA)
    threads: int
    isa: str | None  # rank 0's CPU kernel path, so every rank computes the same way
    log_level: int
    load_format: str = "auto"  # EngineConfig.load_format, the same on every rank
    max_loras: int = 0  # EngineConfig.lora's slots and rank (0: no LoRA); rank 0 hands on the adapters
    max_lora_rank: int = 0
    service_fd: int = -1  # this rank's end of its socket pair with rank 0 (module docstring), inherited
    # A cache sized by a share (``num_blocks`` 0 until then; distributed/memory_share.py): the
    # share, and the profile step every rank runs (``memory_profile.ProfileStep``'s sizes).
    memory_share: float = 0.0
    profile_tokens: int = 0
    profile_rows: int = 0
    max_model_len: int = 0

    def to_json(self) -> str:
        return json.dumps(dataclasses.asdict(self))

    @classmethod
    def from_json(cls, text: str) -> "FollowerSpec":
        return cls(**json.loads(text))


def open_store(path: str, size: int):
    """The ranks' meeting place: a ``FileStore`` (a file in a private directory; no port)."""
    import torch.distributed as dist

    return dist.FileStore(path, size)


def rank_device(device: torch.device, rank: int, size: int) -> torch.device:
    """Where rank ``rank`` of ``size`` computes: on CUDA, device ``rank`` of those this process
    sees (``CUDA_VISIBLE_DEVICES``), or, where there are fewer than ``size``, ``rank`` modulo
    their number (ranks sharing a device: a test of the tensor-parallel path on one GPU);
    elsewhere ``device``."""
    if device.type != "cuda":
        return device
    return torch.device("cuda", rank % torch.cuda.device_count())


def uses_nccl(device: torch.device, size: int) -> bool:
    """NCCL between the ranks where each has a CUDA device of its own; else gloo (NCCL cannot
    run two ranks on one device; gloo moves CUDA tensors through the host)."""
    return device.type == "cuda" and torch.cuda.device_count() >= size


def join(store, rank: int, size: int, device: torch.device):
    """This rank's process group: gloo on loopback, or NCCL on CUDA (``uses_nccl``). Blocks
    until every rank joins. Not torch.distributed's default group, so one process may hold
    several (tests run a prefill and a decode worker in one)."""
    import torch.distributed as dist

    store.set(f"up/{rank}", "1")
    group_store = dist.PrefixStore("group", store)
    if uses_nccl(device, size):
        opts = dist.ProcessGroupNCCL.Options()
        opts._timeout = COLLECTIVE_TIMEOUT
        group = dist.ProcessGroupNCCL(group_store, rank, size, opts)
    else:
        opts = dist.ProcessGroupGloo._Options()
        opts._devices = [dist.ProcessGroupGloo.create_device(hostname="127.0.0.1")]
        opts._timeout = COLLECTIVE_TIMEOUT
        group = dist.ProcessGroupGloo(group_store, rank, size, opts)
    # One collective now: NCCL sets its communicator up at the first one, through the store,
    # which rank 0 removes once every rank has loaded (``RankGroup.wait_loaded``).
    group.allreduce([torch.zeros(1, device=device)]).wait()
    return group


def rank_threads(threads: int, size: int) -> int:
    """Torch threads each rank runs: its share of the worker's (at least one)."""
    return max(1, threads // size)


def rank_cores(cpus: tuple[int, ...], rank: int, size: int) -> tuple[int, ...]:
    """The cores of ``cpus`` that rank ``rank`` is pinned to: an even share each, or all of them
    for every rank where there are fewer cores than ranks."""
    share = len(cpus) // size
    return tuple(cpus[rank * share:(rank + 1) * share]) if share else tuple(cpus)


def load_on_ranks(config: EngineConfig, progress: bool = True, on_lost: Callable[[RankLost], None] | None = None,
                  entry: str = FOLLOWER_ENTRY, probe=None) -> tuple[CausalLM, ModelConfig, Path, "RankGroup | None"]:
    """``load_model`` for ``config``, on ``tensor_parallel_size`` ranks: start the others
    (``entry``: the module they run, module docstring), which load their shares while this
    process (rank 0) loads its own. Returns (rank 0's model, its config, the model directory,
    the ranks; None at size 1). ``probe``: rank 0's memory, where a share sizes the cache."""
    dtype, device = config.torch_dtype(), config.torch_device()
    if config.tensor_parallel_size == 1:
        return (*load_model(config.model, dtype, device, progress, load_format=config.load_format,
                            huge_pages=config.scheduler.policy == MIXED), None)
    model_dir = materialize(config.model, progress)
    cfg = read_model_config(model_dir)
    check_split(cfg, config.tensor_parallel_size)  # before any rank starts
    share = memory_share.measured_by_share(config)  # then every rank measures once loaded, 0 blocks till then
    num_blocks = 0 if share else num_cache_blocks(config, cache_spec_of(cfg, config.cache.block_size, dtype,
                                                                          config.tensor_parallel_size))
    ranks = RankGroup.start(config, model_dir, cfg, num_blocks, on_lost or exit_worker, entry)
    try:
        model, cfg, model_dir = load_model(str(model_dir), dtype, device, progress, ranks.tp, config.load_format,
                                           huge_pages=config.scheduler.policy == MIXED)
        if share:
            ranks.cache_size = memory_share.size_on_rank0(ranks, model, cfg, config, probe)
        ranks.wait_loaded()
    except BaseException:
        ranks.close()
        raise
    return model, cfg, model_dir, ranks


def exit_worker(exc: RankLost) -> None:
    """The default ``on_lost``: end this process now (see the module docstring)."""
    log.critical("%s: this tensor-parallel worker stops", exc)
    logging.shutdown()
    os._exit(EXIT_RANK_LOST)


class RankGroup:
    """Rank 0's handle on its worker's ranks. ``tp``: rank 0's ``TensorParallel``; ``caches``:
    on CPU, every rank's KV cache, (ranks, num_blocks, *block_shape) in shared memory (None on
    CUDA, where each rank's cache is on its own device); ``service_sockets[r - 1]``: rank 0's
    end of rank r's socket pair (module docstring); ``entry``: the module the ranks run."""

    def __init__(self, tp: TensorParallel, store, procs: list[subprocess.Popen], tmpdir: str,
                 caches: torch.Tensor | None, device: torch.device, on_lost: Callable[[RankLost], None],
                 service_sockets: tuple[socket.socket, ...] = (), entry: str = FOLLOWER_ENTRY):
        self.tp, self.caches, self.device = tp, caches, device
        self.service_sockets, self.entry = service_sockets, entry
        self._store, self._procs, self._tmpdir, self._on_lost = store, procs, tmpdir, on_lost
        self._closing = False
        self._threads_before = torch.get_num_threads()
        self._lost: RankLost | None = None
        self._lost_lock = threading.Lock()  # a rank's watch and the stepping thread may both find the loss
        self.cache_fd, self.cache_size = -1, None  # a cache sized by a share: memory_share.size_on_rank0

    @classmethod
    def start(cls, config: EngineConfig, model_dir: Path, cfg: ModelConfig, num_blocks: int,
              on_lost: Callable[[RankLost], None] = exit_worker, entry: str = FOLLOWER_ENTRY) -> "RankGroup":
        """Start ranks 1..N-1 (each running module ``entry``) and join them in a process group;
        they load their shares of the model meanwhile (``wait_loaded``). Rank 0's own cache is
        ``caches[0]`` on CPU."""
        size, device, dtype = config.tensor_parallel_size, config.torch_device(), config.torch_dtype()
        spec = cache_spec_of(cfg, config.cache.block_size, dtype, size)
        caches, fd = shared_caches(spec, num_blocks, size) if device.type == "cpu" else (None, -1)
        tmpdir = tempfile.mkdtemp(prefix="pdserve-tp-")
        threads = rank_threads(torch.get_num_threads(), size)
        common = dict(size=size, store=os.path.join(tmpdir, "store"), model_dir=str(model_dir),
                      dtype=next(k for k, v in DTYPES.items() if v == dtype), device=str(device),
                      attention_backend=config.attention_backend, block_size=config.cache.block_size,
                      num_blocks=num_blocks, cache_fd=fd, threads=threads, isa=_isa(device),
                      log_level=logging.getLogger().getEffectiveLevel(), load_format=config.load_format,
                      max_loras=config.lora.max_loras if config.lora else 0,
                      max_lora_rank=config.lora.max_lora_rank if config.lora else 0,
                      **memory_share.follower_fields(config, cfg))
        pairs = [socket.socketpair() for _ in range(1, size)]
        procs = [_spawn(FollowerSpec(rank=r, service_fd=pairs[r - 1][1].fileno(), **common), entry)
                 for r in range(1, size)]
        for _, theirs in pairs:
            theirs.close()  # the rank holds its end now
        mine = tuple(ours for ours, _ in pairs)
        try:
            if caches is not None:
                prefault(caches[0])
                os.close(fd)  # the other ranks hold it now; the mapping keeps the memory
            store = open_store(common["store"], size)
            _wait_for(procs, lambda: store.check([f"up/{r}" for r in range(1, size)]), "start")
            group = join(store, 0, size, device)
        except BaseException:
            _kill(procs)
            for ours in mine:
                ours.close()
            shutil.rmtree(tmpdir, ignore_errors=True)
            raise
        ranks = cls(TensorParallel(0, size, group), store, procs, tmpdir, caches, device, on_lost, mine, entry)
        ranks.cache_fd = fd if caches is None else -1  # CPU and a share: the file, sized once measured
        torch.set_num_threads(threads)  # rank 0's share too, until ``close``
        return ranks

    def wait_loaded(self) -> None:
        """Block until every rank has loaded its share and mapped its cache; then watch them."""
        keys = [f"loaded/{r}" for r in range(1, self.tp.size)]
        try:
            _wait_for(self._procs, lambda: self._store.check(keys), "load its share of the model")
        except BaseException:
            self.close()
            raise
        shutil.rmtree(self._tmpdir, ignore_errors=True)  # met: nothing is left to read there
        for rank, proc in enumerate(self._procs, start=1):
            threading.Thread(target=self._watch, args=(rank, proc), name=f"tp-rank{rank}-watch", daemon=True).start()

    def step(self, input_ids: torch.Tensor, positions: torch.Tensor, ctx, sample_rows: torch.Tensor,
             lora: tp_step.StepLoRA | None = None) -> None:
        """Hand the step's inputs to the other ranks, which run its forward with rank 0, then
        their slices of the logits of ``sample_rows`` (rows of the step's hidden states, in
        that order; empty: none), which rank 0 computes right after the forward. ``lora``: the
        step's adapters (None: no token uses one)."""
        if self._lost is not None:
            raise self._lost
        tp_step.send_step(self.tp.group, input_ids, positions, ctx, sample_rows, lora)

    def lora_load(self, adapter_id: int, path: str) -> None:
        """Tell the other ranks that rank 0 loaded the adapter at ``path`` as ``adapter_id``;
        each reads its share of it there (docs/lora.md#tensor-parallelism)."""
        if self._lost is not None:
            raise self._lost
        tp_step.send_lora_load(self.tp.group, adapter_id, path, self.device)

    def lora_unload(self, adapter_id: int) -> None:
        """Tell the other ranks that rank 0 unloaded adapter ``adapter_id``."""
        if self._lost is not None:
            raise self._lost
        tp_step.send_lora_unload(self.tp.group, adapter_id, self.device)

    def graphs(self, sizes: tuple[int, ...], width: int, block_size: int, capture: bool) -> None:
        """Tell the other ranks to build the decode graphs rank 0 builds next (``step.Graphs``)."""
        if self._lost is not None:
            raise self._lost
        tp_step.send_graphs(self.tp.group, sizes, width, block_size, capture, self.device)

    def graph_step(self, size: int, inputs: list[torch.Tensor]) -> None:
        """Hand a graphed decode step's padded inputs to the other ranks, which replay theirs."""
        if self._lost is not None:
            raise self._lost
        tp_step.send_graph_step(self.tp.group, size, inputs, self.device)

    def logits(self, start: int, stop: int) -> None:
        """Tell the other ranks that rank 0 computes the logits of rows [start, stop) of the
        step's hidden states next, so that they compute their slices with it."""
        if self._lost is not None:
            raise self._lost
        tp_step.send_logits(self.tp.group, start, stop, self.device)

    def lost(self, cause: BaseException) -> RankLost:
        """The ranks are out of step (a collective failed, or rank 0's forward raised between
        two of them): ``on_lost``, then the error to raise."""
        with self._lost_lock:
            first = self._lost is None
            if first:
                self._lost = RankLost(f"tensor-parallel rank lost ({type(cause).__name__}: {cause})")
        if first:
            self._on_lost(self._lost)
        return self._lost

    def pin(self, cpus: tuple[int, ...]) -> tuple[int, ...]:
        """Pin each other rank to its share of ``cpus`` (every thread of its process); returns
        rank 0's share, for the caller to pin itself to."""
        for rank, proc in enumerate(self._procs, start=1):
            cores = set(rank_cores(cpus, rank, self.tp.size))
            for tid in os.listdir(f"/proc/{proc.pid}/task"):
                try:
                    os.sched_setaffinity(int(tid), cores)
                except (ProcessLookupError, PermissionError):  # the thread ended meanwhile
                    pass
        return rank_cores(cpus, 0, self.tp.size)

    def rank_caches(self) -> tuple[torch.Tensor, ...]:
        """Every rank's cache, ``[r]`` rank r's, each a view of the one shared file, for rank 0
        to look into (tests). CPU only: on CUDA each rank's cache is in its own process's device
        memory (each rank's KV-transfer agent is created in that rank's process,
        pdserve/kv_transfer/remote_agent.py)."""
        if self.caches is None:
            raise InvalidRequestError("tensor_parallel_size", f"rank 0 sees only its own cache on {self.device.type}; "
                                      "every rank's is readable here on CPU only", 1)
        return tuple(self.caches.unbind(0))

    def close(self, graceful: bool = True, timeout_s: float = 10.0) -> None:
        """Stop the other ranks and remove the meeting place. ``graceful``: no step runs (the
        thread that steps is done, or this is it), so they are told to stop; else, and for any
        that does not within ``timeout_s``, they are killed. Idempotent."""
        if self._closing:
            return
        self._closing = True
        if graceful and self._lost is None and all(p.poll() is None for p in self._procs):
            try:
                tp_step.send_stop(self.tp.group, self.device)
            except Exception as exc:  # a rank went meanwhile: it is stopping anyway
                log.warning("stopping the tensor-parallel ranks: %s", exc)
        deadline = time.monotonic() + (timeout_s if graceful else 0.0)
        for proc in self._procs:
            try:
                proc.wait(max(0.0, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
        for ours in self.service_sockets:
            ours.close()
        shutil.rmtree(self._tmpdir, ignore_errors=True)
        torch.set_num_threads(self._threads_before)

    def _watch(self, rank: int, proc: subprocess.Popen) -> None:
        code = proc.wait()
        if not self._closing:
            self.lost(RuntimeError(f"rank {rank} (pid {proc.pid}) exited with status {code}"))


def _isa(device: torch.device) -> str | None:
    """This process's CPU kernel path, where the kernels run (else None)."""
    from pdserve.engine.kernels import cpu_kernels

    if device.type != "cpu" or not cpu_kernels.cpu_supported():
        return None
    cpu_kernels.load()
    return cpu_kernels.isa()
