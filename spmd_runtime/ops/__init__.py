"""Op families beyond the core set, one module each (like XLA's per-op SPMD handlers).

Each family module defines, for its ops: the traced NumPy-style functions (listed in
its ``__all__`` and re-exported by ``spmd_runtime.numpy``), the local kernels
(``exec.kernels.kernel``), the propagation rules (``partition.propagation.rule``)
and the partition rules (``partition.partitioner.partition_rule``).
"""
import importlib

FAMILIES = ("slicing", "gather", "windows", "indexing", "windows_grad")

__all__: list[str] = []
for _name in FAMILIES:
    try:
        _module = importlib.import_module(f"{__name__}.{_name}")
    except ModuleNotFoundError as e:  # a family not written yet
        if e.name != f"{__name__}.{_name}":
            raise
        continue
    for _fn in getattr(_module, "__all__", ()):
        globals()[_fn] = getattr(_module, _fn)
        __all__.append(_fn)
