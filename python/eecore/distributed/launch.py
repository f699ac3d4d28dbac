"""Starting the ranks of a tensor-parallel engine: worker processes on this machine (spawned by rank
0's `LLM`), or the processes `torchrun` started on one or more machines.

One machine: `LLM(tensor_parallel_size=N)` spawns N - 1 workers; each joins the group, builds the
same LLM from the same options (its own slice of the weights) and follows rank 0's steps
(`eecore.distributed.lockstep.follow`) until rank 0 shuts down, or dies (the workers watch it).

Several machines: start every rank with torchrun, e.g. on each of two 4-GPU nodes

    torchrun --nnodes 2 --nproc-per-node 4 --rdzv-backend c10d --rdzv-endpoint HOST:29500 \\
        -m eecore.cli serve MODEL --tensor-parallel-size 8

and each process takes its rank from torchrun's environment; rank 0 serves, the others follow.
"""
from __future__ import annotations

import atexit
import os
import pickle
import socket
import subprocess
import sys
import time
from typing import Callable, Optional

import torch

from eecore.distributed.group import TensorParallelGroup, init_group


def rank_device(device: torch.device, local_rank: int) -> torch.device:
    """A rank's device: its own GPU (cuda:local_rank), or the CPU."""
    device = torch.device(device)
    return torch.device("cuda", local_rank) if device.type == "cuda" else device


def check_devices(device: torch.device, world_size: int) -> None:
    if device.type == "cuda" and world_size > torch.cuda.device_count():
        raise ValueError(f"tensor_parallel_size={world_size} exceeds the {torch.cuda.device_count()} GPU(s) "
                         "of this machine (several machines: start the ranks with torchrun)")


def threads_per_rank(world_size: int) -> int:
    """CPU threads for each rank of `world_size` on this machine (the ranks share its cores)."""
    return max(1, (os.cpu_count() or 1) // world_size)


class Workers:
    """The worker processes rank 0 started and the group they joined.

    A worker is a fresh interpreter (`python -m eecore.distributed.worker`, its options pickled on
    its stdin), not a multiprocessing child: the user's script is never imported again, so it needs
    no `if __name__ == "__main__"` guard, and nothing of rank 0's state (threads, a GPU context)
    is inherited."""

    def __init__(self, world_size: int, options: dict, device: torch.device, timeout_s: float):
        check_devices(device, world_size)
        init_method = f"tcp://127.0.0.1:{_free_port()}"
        threads = threads_per_rank(world_size)
        self.processes: list[subprocess.Popen] = []
        for rank in range(1, world_size):
            p = subprocess.Popen([sys.executable, "-m", "eecore.distributed.worker"], stdin=subprocess.PIPE)
            p.stdin.write(pickle.dumps((rank, world_size, init_method, timeout_s, options, device.type, threads,
                                        os.getpid())))
            p.stdin.close()
            self.processes.append(p)
        torch.set_num_threads(threads)  # every rank alike: the replicated parts then round alike too
        try:
            self.group = init_group(0, world_size, init_method, timeout_s, rank_device(device, 0))
        except Exception as e:
            self.terminate()
            raise RuntimeError(f"tensor parallel workers did not join within {timeout_s:g} s: {self.state()}") from e
        self.group.diagnose = self.state
        atexit.register(self.terminate)

    def state(self) -> str:
        dead = [f"rank {i + 1} exited with code {p.returncode}" for i, p in enumerate(self.processes)
                if p.poll() is not None]
        return ", ".join(dead) if dead else "every worker process is alive"

    def terminate(self, grace_s: float = 5.0) -> None:
        deadline = time.monotonic() + grace_s
        for p in self.processes:
            try:
                p.wait(max(0.0, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait(1.0)


def measured_choices(group: TensorParallelGroup) -> dict[str, str]:
    """The choices a process makes by timing its own machine, as environment switches, made by rank 0
    for every rank (ranks that chose apart would run different arithmetic): the 8-bit form of a
    draft copy's weights. Every rank calls this, in step; only rank 0 times anything."""
    from eecore.models.int8_weights import integer_gguf_kernel

    q8 = group.leader_float((1.0 if integer_gguf_kernel() else 0.0) if group.is_leader else 0.0)
    return {"EECORE_EIGHT_BIT": "q8_0" if q8 else "int8"}


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def serve_as_follower(group: TensorParallelGroup, options: dict,
                      build: Optional[Callable[[TensorParallelGroup, dict], object]] = None) -> None:
    """Builds this rank's LLM and follows rank 0 until it stops."""
    from eecore.distributed.lockstep import follow

    if build is None:
        import eecore

        build = eecore.LLM.follower
    llm = build(group, options)
    follow(llm.engine, group)
