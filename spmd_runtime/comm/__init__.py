"""Communication layer: mesh-axis communicators, array collectives, and an in-process MPI simulation."""
from spmd_runtime.comm.collectives import (all_gather, all_reduce, all_to_all, broadcast, collective_permute,
                                           reduce_scatter)
from spmd_runtime.comm.communicator import MeshCommunicator
from spmd_runtime.comm.gpu import Transport, cuda_aware_mpi, is_device_array
from spmd_runtime.comm.simulated import SimulatedAbort, SimulatedComm, run_simulated

__all__ = [
    "MeshCommunicator",
    "all_reduce",
    "all_gather",
    "reduce_scatter",
    "all_to_all",
    "collective_permute",
    "broadcast",
    "run_simulated",
    "SimulatedComm",
    "SimulatedAbort",
    "Transport",
    "cuda_aware_mpi",
    "is_device_array",
]
