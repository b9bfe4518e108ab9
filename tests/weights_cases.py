"""What the unit and MPI tests of spmd_runtime/weights.py share: the layout rule's slice of each rank, and a
safetensors reader that records every slice the loader asks the file for (and fails a whole-tensor read)."""
from __future__ import annotations

from safetensors import safe_open

from spmd_runtime import parse_spec
from spmd_runtime.exec import block_slices


def true_slices(shape, spec, mesh, rank):
    """The slices of the global array that ``rank`` holds under ``spec`` on ``mesh`` (the layout rule)."""
    return block_slices(shape, parse_spec(spec, mesh, len(shape)), mesh, rank)


def bounds(slices):
    return tuple((s.start, s.stop) for s in slices)


def recording_reader(record):
    """A stand-in for ``safe_open`` that calls ``record(key, bounds)`` for every slice read through it; reading
    a whole tensor fails (the loader must ask for its own blocks only)."""
    class Slice:
        def __init__(self, real, key):
            self.real, self.key = real, key

        def get_shape(self):
            return self.real.get_shape()

        def get_dtype(self):
            return self.real.get_dtype()

        def __getitem__(self, slices):
            record(self.key, bounds(slices))
            return self.real[slices]

    class Opened:
        def __init__(self, path, framework):
            self.handle = safe_open(path, framework=framework)

        def __enter__(self):
            self.real = self.handle.__enter__()
            return self

        def __exit__(self, *exc):
            return self.handle.__exit__(*exc)

        def keys(self):
            return self.real.keys()

        def metadata(self):
            return self.real.metadata()

        def get_slice(self, key):
            return Slice(self.real.get_slice(key), key)

        def get_tensor(self, key):
            raise AssertionError(f"the loader read the whole of {key!r}")

    return Opened
