"""Running one model over several processes: tensor parallelism on torch.distributed (NCCL on GPUs,
gloo on the CPU), every rank's engine in lockstep with rank 0's. docs/distributed.md has the design
and the cost model.

    group.py     the process group: the pass's collectives, rank 0's control messages, errors
    launch.py    starting the ranks: worker processes on one machine, or torchrun's
    worker.py    a worker process's entry point
    lockstep.py  rank 0's engine (LeaderEngine) and the workers' loop (follow)

The weights' split and the vocabulary-parallel embedding and head are the model's
(eecore.models.tensor_parallel, eecore.models.vocab_parallel).
"""
from eecore.distributed.group import TensorParallelError, TensorParallelGroup

__all__ = ["TensorParallelError", "TensorParallelGroup"]
