"""One tensor-parallel group as the model and the engine use it: the collectives a pass makes, the
control messages that keep the ranks in lockstep, and errors that say which rank failed.

Two process groups under one object. The data group (NCCL on GPUs, gloo on the CPU) carries the
pass's collectives and waits at most `timeout_s`: a rank that died or stopped answering turns into a
`TensorParallelError` within that bound, never a hang. The control group (gloo, no practical
timeout) carries rank 0's step messages: a worker waits there while the engine is idle, which may
be hours for a server.

Every collective result is the same tensor on every rank (the collective's contract), so a decision
computed from one (an exit check's count, an acceptance length) is the same everywhere without a
second message; `counts` records what each pass made (the tests hold a decode step to two
all-reduces a layer).
"""
from __future__ import annotations

import pickle
from collections import Counter
from datetime import timedelta
from typing import Callable, Optional

import torch
import torch.distributed as dist

# control messages: a fixed header [kind, payload bytes], then the payload when there is one
STEP, STOP = 1, 2


class TensorParallelError(RuntimeError):
    """A tensor-parallel rank failed, died or stopped answering; the engine cannot go on."""

    fatal = True  # the server ends every request (503) and exits, instead of retrying the step


class TensorParallelGroup:
    def __init__(self, rank: int, world_size: int, data_group, control_group, timeout_s: float,
                 device: torch.device):
        self.rank = rank
        self.world_size = world_size
        self.data_group = data_group
        self.control_group = control_group
        self.timeout_s = timeout_s
        self.device = torch.device(device)
        self.counts: Counter = Counter()  # collectives made, by kind
        # the launcher's view of the other ranks (exit codes of spawned workers), for error messages
        self.diagnose: Callable[[], str] = lambda: ""
        self.failed = False  # a collective failed: the group is unusable (shutdown sends nothing more)
        self._header = torch.zeros(2, dtype=torch.int64)
        self._scalar = torch.zeros(1, dtype=torch.float64, device=self.device)

    @property
    def is_leader(self) -> bool:
        return self.rank == 0

    # ---- the pass's collectives (data group) ---------------------------------------------------
    def all_reduce_(self, tensor: torch.Tensor) -> torch.Tensor:
        """Sums `tensor` over the ranks, in place."""
        self.counts["all_reduce"] += 1
        self._run(lambda: dist.all_reduce(tensor, group=self.data_group), "all_reduce")
        return tensor

    def all_gather_into(self, out: torch.Tensor, tensor: torch.Tensor) -> torch.Tensor:
        """`out` (world_size times `tensor`'s rows) gets every rank's `tensor`, in rank order."""
        self.counts["all_gather"] += 1
        self._run(lambda: _all_gather(out, tensor.contiguous(), group=self.data_group),
                  "all_gather")
        return out

    def agree_min(self, value: int) -> int:
        """The smallest of every rank's `value` (sizes each rank plans from its own free memory)."""
        t = torch.tensor([value], dtype=torch.int64, device=self.device)
        self._run(lambda: dist.all_reduce(t, op=dist.ReduceOp.MIN, group=self.data_group), "agree_min")
        return int(t.item())

    def leader_float(self, value: float) -> float:
        """Rank 0's `value` on every rank: a measurement (a pass's seconds) that host decisions use,
        which each rank would otherwise measure differently."""
        self.counts["broadcast"] += 1
        self._scalar.fill_(value)
        self._run(lambda: dist.broadcast(self._scalar, src=0, group=self.data_group), "broadcast")
        return float(self._scalar.item())

    def close(self) -> None:
        """Leaves the process groups. The ProcessGroup objects go now, not at interpreter exit, where
        destroying gloo's threads in no set order aborted the process."""
        if dist.is_initialized():
            dist.destroy_process_group()
        self.data_group = self.control_group = None

    # ---- control messages (rank 0 to the others) -------------------------------------------------
    def send_control(self, kind: int, payload: Optional[object] = None) -> None:
        data = b"" if payload is None else pickle.dumps(payload, protocol=pickle.HIGHEST_PROTOCOL)
        self._header[0], self._header[1] = kind, len(data)
        # the control group waits without end (a worker idles there), so rank 0 bounds its own sends
        bounded = timedelta(seconds=self.timeout_s)
        self._run(lambda: dist.broadcast(self._header, src=0, group=self.control_group, async_op=True).wait(bounded),
                  "a step message")
        if data:
            buf = torch.frombuffer(bytearray(data), dtype=torch.uint8)
            self._run(lambda: dist.broadcast(buf, src=0, group=self.control_group, async_op=True).wait(bounded),
                      "a step message")

    def receive_control(self) -> tuple[int, Optional[object]]:
        dist.broadcast(self._header, src=0, group=self.control_group)
        kind, size = int(self._header[0]), int(self._header[1])
        if not size:
            return kind, None
        buf = torch.empty(size, dtype=torch.uint8)
        dist.broadcast(buf, src=0, group=self.control_group)
        return kind, pickle.loads(buf.numpy().tobytes())

    def _run(self, collective: Callable[[], object], what: str) -> None:
        try:
            collective()
        except Exception as e:  # gloo and NCCL raise RuntimeError or DistBackendError
            self.failed = True
            state = self.diagnose()
            raise TensorParallelError(
                f"tensor parallel rank {self.rank} of {self.world_size}: {what} failed within "
                f"{self.timeout_s:g} s: a rank died or stopped answering{'; ' + state if state else ''} "
                f"({type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''})") from e


def init_group(rank: int, world_size: int, init_method: str, timeout_s: float,
               device: torch.device) -> TensorParallelGroup:
    """Joins this process to the group at `init_method` (a tcp:// address, or "env://" under
    torchrun) and returns it."""
    device = torch.device(device)
    backend = "nccl" if device.type == "cuda" else "gloo"
    dist.init_process_group(backend, init_method=init_method, rank=rank, world_size=world_size,
                            timeout=timedelta(seconds=timeout_s))
    data = dist.group.WORLD
    control = dist.new_group(backend="gloo", timeout=timedelta(days=365))
    return TensorParallelGroup(rank, world_size, data, control, timeout_s, device)


# torch renamed all_gather_into_tensor (the old name warns from 2.13 on)
_all_gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
