"""The processes of one multi-GPU model instance: rank 0 (the engine's own process: scheduler, sampling) spawns ranks
1..n-1, each running its shard of the text tower (and, with EngineConfig.vision_tensor_parallel, of the vision
tower), and sends them every step's inputs and every tower call's work, in the order rank 0 runs them.

Control messages (small: the flat batch's host arrays, block tables, image grids) go down one pipe per rank,
pickled; large tensors (visual embeddings, imported KV, the images' uint8 patches) follow as broadcasts on the
instance's torch.distributed group (NCCL on CUDA, gloo on CPU), so nothing large crosses the host between GPUs.
Ranks are spawned with torch.multiprocessing ('spawn'), as vLLM's multiprocessing executor does; inside a Ray actor
that owns the instance's GPUs this is the same (the actor is rank 0).

The group meets through a FileStore in a directory of rank 0's, not a TCPStore: every rank is on this host, and a
TCPStore's server listens on every interface whatever address it is given. A gloo group's own sockets are kept on
loopback (GLOO_SOCKET_IFNAME, https://pytorch.org/docs/stable/distributed.html#common-environment-variables).

Start-up never waits silently: each rank reports its phase up its pipe; rank 0 joins the process group only
once every rank is up, and a watcher thread names a rank that exits (aborting the group, so a collective
waiting on it fails at once) or that stays in one phase too long (its Python stacks dumped to its stderr).
"""

from __future__ import annotations

import datetime
import faulthandler
import logging
import os
import pickle
import shutil
import signal
import tempfile
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from workers.config import EngineConfig
from workers.core.encoder_cache import ImageKey
from workers.executor.decode_graphs import StepBatch
from workers.model.text import VisualRows
from workers.parallel import TensorParallel

log = logging.getLogger(__name__)

COLLECTIVE_TIMEOUT = datetime.timedelta(minutes=10)
SPAWN_TIMEOUT_S = 180.0  # a rank's process: interpreter, imports, CUDA context on its device
SLOW_PHASE_S = 60.0  # a rank longer than this in one start-up phase is reported (and again at every multiple)
GLOO_INTERFACE_ENV = "GLOO_SOCKET_IFNAME"
LOOPBACK_INTERFACE = "lo"


class RankStartupError(RuntimeError):
    """A rank of a multi-GPU instance did not come up; the message names the rank and the phase."""


@dataclass
class StepInputs:
    """Everything every rank needs to run one step's forward pass."""

    batch: StepBatch
    visual: VisualRows | None
    imports: list[tuple[list[int], torch.Tensor]]  # (block table, KV [layers, 2, tokens, all kv heads, head_dim])


@dataclass
class PassBlocks:
    """Blocks [first_block, first_block + num_blocks) of an image's tower pass spread over steps; patches (uint8
    [n, 3, 256] on the device) and grid ([1, 3]) where the pass begins (first_block 0), else None."""

    key: ImageKey
    first_block: int
    num_blocks: int
    patches: torch.Tensor | None = None
    grid: torch.Tensor | None = None


@dataclass
class TowerWork:
    """One call's vision-tower work, as every rank of a tensor-parallel tower runs it: whole images in one pass
    together (their uint8 patches concatenated, grids [n, 3]), then the blocks of passes spread over steps."""

    whole: list[tuple[ImageKey, int]]  # (key, visual tokens) of each whole image, in patch order
    whole_patches: torch.Tensor | None
    whole_grids: torch.Tensor | None
    passes: list[PassBlocks]


def rank_device(config: EngineConfig, rank: int) -> str:
    """Rank r of an instance whose config names cuda:N uses cuda:N+r; CPU ranks all use the CPU."""
    if not config.is_cuda:
        return "cpu"
    base = int(config.device.split(":")[1]) if ":" in config.device else 0
    return f"cuda:{base + rank}"


def init_rank(config: EngineConfig, rank: int, init_method: str) -> TensorParallel:
    """Joins the instance's process group (the default group of this process). A gloo group's sockets bind
    loopback unless the operator named an interface (GLOO_SOCKET_IFNAME, set to lo in this process otherwise)."""
    device = rank_device(config, rank)
    if config.is_cuda:
        torch.cuda.set_device(device)
    else:
        os.environ.setdefault(GLOO_INTERFACE_ENV, LOOPBACK_INTERFACE)
    try:
        dist.init_process_group(
            "nccl" if config.is_cuda else "gloo", init_method=init_method, rank=rank,
            world_size=config.tensor_parallel_size, timeout=COLLECTIVE_TIMEOUT,
        )
    except (RuntimeError, dist.DistError) as exc:
        raise RankStartupError(f"rank {rank} ({device}): joining the process group at {init_method} failed: {exc}") from exc
    return TensorParallel(rank, config.tensor_parallel_size, config.expert_parallel, dist.group.WORLD)


class RankGroup:
    """Rank 0's handle on ranks 1..n-1: start them, send them steps and commands, stop them."""

    def __init__(self, config: EngineConfig, build_runner: Callable):
        """build_runner(config, model_config, tp): the model runner each rank >= 1 serves steps with (the
        ModelRunner class; passed in, so that this module does not import the runner that imports it)."""
        self._store_dir = Path(tempfile.mkdtemp(prefix="q3vl-ranks-"))  # fresh: a FileStore's old file would be read
        self.init_method = init_method = (self._store_dir / "store").as_uri()  # where the ranks meet
        ctx = mp.get_context("spawn")
        self.pipes = []
        self.procs = []
        self.phases: dict[int, str] = {}
        self._closing = threading.Event()
        for rank in range(1, config.tensor_parallel_size):
            parent, child = ctx.Pipe()
            proc = ctx.Process(target=_rank_main, args=(config, rank, init_method, child, build_runner), daemon=True,
                               name=f"q3vl-rank{rank}")
            proc.start()
            child.close()
            self.pipes.append(parent)
            self.procs.append(proc)
            self.phases[rank] = f"spawn (interpreter, imports, CUDA context on {rank_device(config, rank)})"
        try:
            self._wait_spawned(time.monotonic() + SPAWN_TIMEOUT_S)
            self.tp = init_rank(config, 0, init_method)
        except BaseException:
            self._kill()
            shutil.rmtree(self._store_dir, ignore_errors=True)
            raise
        self._watcher = threading.Thread(target=self._watch, name="q3vl-rank-watch", daemon=True)
        self._watcher.start()

    def _read_phases(self) -> None:
        for rank, pipe in enumerate(self.pipes, start=1):
            try:
                while pipe.poll(0):
                    self.phases[rank] = pipe.recv()[1]
            except (EOFError, OSError):  # the rank exited: its exit code tells the rest
                continue

    def _wait_spawned(self, deadline: float) -> None:
        """Until every rank >= 1 is about to join the process group; RankStartupError naming one that is not."""
        while True:
            self._read_phases()
            for rank, proc in enumerate(self.procs, start=1):
                if proc.exitcode is not None:
                    raise RankStartupError(f"rank {rank} (pid {proc.pid}) exited with code {proc.exitcode} in start-up "
                                           f"phase {self.phases[rank]!r}; its error is on stderr above")
            if all(phase.startswith("join") for phase in self.phases.values()):
                return
            if time.monotonic() > deadline:
                late = {r: p for r, p in self.phases.items() if not p.startswith("join")}
                raise RankStartupError(f"ranks {sorted(late)} not up after {SPAWN_TIMEOUT_S:.0f} s: phases {late}")
            time.sleep(0.05)

    def _watch(self) -> None:
        """Rank 0's watcher: a rank that exits fails the instance at once (the group is aborted so that a
        collective waiting for it raises); a rank slow in a start-up phase is named and its stacks dumped."""
        since = {rank: (phase, time.monotonic(), 1) for rank, phase in self.phases.items()}
        while not self._closing.wait(0.5):
            self._read_phases()
            for rank, proc in enumerate(self.procs, start=1):
                phase = self.phases[rank]
                if proc.exitcode is not None and not self._closing.is_set():
                    log.error("rank %d (pid %d) exited with code %s in phase %r: aborting the instance's process group",
                              rank, proc.pid, proc.exitcode, phase)
                    self.tp.group.abort()
                    return
                last, start, warned = since[rank]
                if phase != last:
                    since[rank] = (phase, time.monotonic(), 1)
                elif phase != "ready" and time.monotonic() - start > warned * SLOW_PHASE_S:
                    log.warning("rank %d (pid %d) still in start-up phase %r after %.0f s; its stacks follow on its "
                                "stderr", rank, proc.pid, phase, time.monotonic() - start)
                    os.kill(proc.pid, signal.SIGUSR1)
                    since[rank] = (phase, start, warned + 1)

    def send(self, message: tuple) -> None:
        dead = [p.name for p in self.procs if not p.is_alive()]
        if dead and message[0] != "stop":
            raise RuntimeError(f"rank process(es) {dead} of this instance exited; the instance must be restarted")
        data = pickle.dumps(message, protocol=pickle.HIGHEST_PROTOCOL)
        for pipe in self.pipes:
            pipe.send_bytes(data)

    def send_step(self, inputs: StepInputs) -> None:
        """Rank 0: the step's host arrays down the pipes, then its device tensors by broadcast."""
        v = inputs.visual
        visual_meta = None if v is None else (v.rows.cpu(), len(v.deepstack))
        self.send(("step", inputs.batch, visual_meta, [(table, tuple(kv.shape)) for table, kv in inputs.imports]))
        if v is not None:
            dist.broadcast(torch.stack([v.embeds, *v.deepstack]).contiguous(), 0, group=self.tp.group)
        for _, kv in inputs.imports:  # FP8 rows as bytes: the collectives need not know float8
            dist.broadcast(kv.view(torch.uint8) if kv.dtype.itemsize == 1 else kv, 0, group=self.tp.group)

    def send_tower_work(self, work: TowerWork) -> None:
        """Rank 0 of a tensor-parallel tower: the call's keys, block ranges and patch shapes down the pipes, then
        the patches by broadcast (whole images' first, then each beginning pass's, in list order)."""
        def listed(t: torch.Tensor | None):  # shapes and grids as plain lists down the pipes
            return None if t is None else t.tolist()

        def shape(t: torch.Tensor | None):
            return None if t is None else tuple(t.shape)

        passes = [(p.key, p.first_block, p.num_blocks, listed(p.grid), shape(p.patches)) for p in work.passes]
        self.send(("encode", work.whole, shape(work.whole_patches), listed(work.whole_grids), passes))
        for patches in (work.whole_patches, *(p.patches for p in work.passes)):
            if patches is not None:
                dist.broadcast(patches.contiguous(), 0, group=self.tp.group)

    def close(self) -> None:
        self._closing.set()
        try:
            self.send(("stop",))
        except (BrokenPipeError, OSError):
            pass
        for proc in self.procs:
            proc.join(timeout=30)
        stuck = [p.name for p in self.procs if p.is_alive()]
        self._kill()
        try:
            self._leave_group(stuck)
        finally:
            shutil.rmtree(self._store_dir, ignore_errors=True)

    @staticmethod
    def _leave_group(stuck: list[str]) -> None:
        if not dist.is_initialized():
            return
        if not stuck:
            dist.destroy_process_group()
            return
        # A destroy with a killed peer can wait forever for it: abort this end of the communicator instead.
        log.warning("rank process(es) %s did not stop within 30 s and were killed; aborting the process group", stuck)
        abort = getattr(dist.distributed_c10d, "_abort_process_group", None)
        if abort is not None:
            abort()

    def _kill(self) -> None:
        self._closing.set()
        for proc in self.procs:
            if proc.is_alive():
                proc.kill()
            proc.join(timeout=5)


def receive_step(
    message: tuple, tp: TensorParallel, device: torch.device, dtype: torch.dtype, kv_dtype: torch.dtype, hidden: int
) -> StepInputs:
    """Ranks 1..n-1: the step rank 0 sent (the device tensors arrive by broadcast); dtype: the activations',
    kv_dtype: the KV cache's (imported rows arrive as the cache stores them)."""
    _, batch, visual_meta, import_meta = message
    visual = None
    if visual_meta is not None:
        rows, depth = visual_meta
        stacked = torch.empty(1 + depth, len(rows), hidden, dtype=dtype, device=device)
        dist.broadcast(stacked, 0, group=tp.group)
        visual = VisualRows(rows.to(device), stacked[0], list(stacked[1:]))
    imports = []
    for table, shape in import_meta:
        kv = torch.empty(shape, dtype=kv_dtype, device=device)
        dist.broadcast(kv.view(torch.uint8) if kv.dtype.itemsize == 1 else kv, 0, group=tp.group)
        imports.append((table, kv))
    return StepInputs(batch, visual, imports)


def receive_tower_work(message: tuple, tp: TensorParallel, device: torch.device) -> TowerWork:
    """Ranks 1..n-1: the tower work rank 0 sent (send_tower_work), its patches received by broadcast."""
    _, whole, shape, grids, passes = message

    def patches(shape: tuple[int, ...] | None) -> torch.Tensor | None:
        if shape is None:
            return None
        out = torch.empty(shape, dtype=torch.uint8, device=device)
        dist.broadcast(out, 0, group=tp.group)
        return out

    def grid(rows: list | None) -> torch.Tensor | None:
        return None if rows is None else torch.tensor(rows)

    whole_patches = patches(shape)  # the broadcasts in send_tower_work's order
    return TowerWork(whole, whole_patches, grid(grids), [PassBlocks(key, first, count, patches(pshape), grid(rows))
                                                         for key, first, count, rows, pshape in passes])


def _rank_main(config: EngineConfig, rank: int, init_method: str, pipe, build_runner: Callable) -> None:
    """Body of rank r >= 1: build this rank's shard of the model, then serve rank 0's messages until told to stop
    (or until rank 0's end of the pipe closes)."""
    from workers.model_config import load_model_config

    logging.basicConfig(level=os.environ.get("Q3VL_RANK_LOG", "WARNING"))
    faulthandler.register(signal.SIGUSR1, all_threads=True)  # rank 0's watcher asks for stacks of a slow start-up
    pipe.send(("phase", f"joining the process group at {init_method}"))
    tp = init_rank(config, rank, init_method)
    pipe.send(("phase", "building the model shard (collectives with rank 0: KV pool size, CUDA graphs)"))
    runner = build_runner(config.model_copy(update={"device": rank_device(config, rank)}), load_model_config(config.checkpoint), tp)
    pipe.send(("phase", "ready"))
    while True:
        try:
            message = pickle.loads(pipe.recv_bytes())
        except EOFError:
            break
        kind = message[0]
        if kind == "stop":
            break
        if kind == "step":
            runner.forward(receive_step(message, tp, runner.device, runner.dtype, runner.kv_dtype, runner.model_config.text.hidden_size), [])
        elif kind == "encode":
            runner.run_tower(receive_tower_work(message, tp, runner.device))
        elif kind == "vision_drop":
            runner.drop_pass(message[1])
        elif kind == "gather_kv":
            runner.gather_kv(message[1], message[2])
        else:
            raise RuntimeError(f"rank {rank}: unknown message {kind!r}")
    runner.close()  # its decode graphs hold captured NCCL work: free them before the communicator goes
    dist.destroy_process_group()
