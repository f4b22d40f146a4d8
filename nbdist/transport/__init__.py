"""The transport: the only package that talks MPI (and torch.distributed's NCCL and gloo).

Who talks to whom, over which buffers, and how long anyone waits: the role loops
(nbdist.roles) call these channels and collectives and never post an MPI request
themselves (tests/test_architecture.py holds them to it). Weights and gradients travel as
one contiguous float32 buffer each, with mpi4py's buffer methods; every wait is polled,
with a deadline, and a failed or silent peer becomes one named error.

Channels between roles:
    master_channel   a master's end of the master/worker exchange (posted receives, replies)
    worker_channel   a worker's leader's end of it
    messages         the wire format: a small header in front of a flat payload
    pool             a master's reused receive buffers for message bodies
    study_channel    a study's coordinator and its groups
    pipeline         activations and their gradients between pipeline stages

Collectives and reductions:
    collectives      nonblocking collectives polled with the run's deadline
    reducers         the allreduce topology's bucketed gradient reduction (REDUCERS: mpi,
                     nccl, gloo), chosen by --allreduce-backend
    reduction        a gradient's allreduce through a codec (--compression)
    compression      the codecs themselves (CODECS: none, fp16, bf16, topk, powersgd); numpy
                     only
    batch_sums       small in-place sums from inside forward and backward (synchronised
                     BatchNorm)
    torch_group      a torch.distributed process group made from an MPI communicator
    staging          a flat array on a device, seen by MPI as a host buffer
    heap             freed memory kept for the next step (glibc's malloc thresholds)

Waiting and failures:
    waiting          polled waits on MPI requests, never forever
    deadlines        how long a peer may stay silent before it counts as frozen
    peers            one rank's view of its run's other ranks
    control          a run's control channel: one rank's failure told to every other at once
    agreement        set-up errors agreed on by every rank
    faults           rank failures: what a survivor raises and how it names the rank
    node             where a process is: the world communicator, its node and local rank
    start            how a process starts MPI: a launched rank, or a singleton at once

Importing this package imports no module of it, and so no MPI: the options read the
registries of `compression` and `reducers`, which import MPI and torch only when a
reducer is made.
"""
