"""A tensor-parallel worker process: `python -m eecore.distributed.worker`, started by rank 0
(eecore.distributed.launch.Workers) with its rank and the LLM's options pickled on stdin."""
from __future__ import annotations

import os
import pickle
import sys
import threading
import time

import torch

from eecore.distributed.group import init_group
from eecore.distributed.launch import rank_device, serve_as_follower


def _watch_parent(parent: int) -> None:
    """A worker outlives no leader: once rank 0's process is gone, exit."""
    while True:
        if os.getppid() != parent:
            os._exit(1)
        time.sleep(0.5)


def main(rank: int, world_size: int, init_method: str, timeout_s: float, options: dict, device_type: str,
         threads: int, parent: int) -> None:
    torch.set_num_threads(threads)
    threading.Thread(target=_watch_parent, args=(parent,), daemon=True).start()
    device = rank_device(torch.device(device_type), rank)
    group = init_group(rank, world_size, init_method, timeout_s, device)
    serve_as_follower(group, dict(options, device=str(device)))
    group.close()


if __name__ == "__main__":
    main(*pickle.loads(sys.stdin.buffer.read()))
