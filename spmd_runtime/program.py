"""The SPMD program: ONE instruction list that every rank runs on its own shards.

In listings, ``%7!`` marks an operand whose buffer dies there and receives the result in place.

Instructions name local shapes; rank-dependent behaviour (which block to slice,
which peer to exchange with) is expressed through the mesh and resolved by each
rank at load time. Saved as versioned, human-readable JSON with a content hash.
"""
from __future__ import annotations

import base64
import hashlib
import hmac
import io
import json
import os
from dataclasses import dataclass, field, replace

import numpy as np

from .estimate import estimate
from .graph import PARAMETER
from .hardware import Hardware
from .mesh import Mesh
from .cost import DEFAULT_MODEL, CostModel, collective_kind, group_size, wire_bytes
from .opdef import lookup
from .live_buffers import LiveBuffers
from .npy import load_npy
from .ops.control import SCAN, WHILE
from .dtypes import LOW_PRECISION, dtype as parse_dtype
from .program_check import check_program
from .sharding import Sharding

FORMAT_VERSION = 1


@dataclass
class Instr:
    op: str
    out: int
    args: tuple[int, ...]
    attrs: dict
    shape: tuple[int, ...]  # local shape on every rank
    dtype: str
    sharding: Sharding
    global_shape: tuple[int, ...]
    free: tuple[int, ...] = ()  # slots whose last use is this instruction
    donate: int = -1  # operand position whose dying buffer receives the result (in place), or -1
    source: tuple | None = field(default=None, compare=False, repr=False)  # the user's (file, line); not saved

    @property
    def nbytes(self) -> int:
        return int(np.prod(self.shape)) * np.dtype(self.dtype).itemsize

    def renumbered(self, new: dict, **changes) -> "Instr":
        """A copy with its slot and operands renamed by ``new`` (old slot -> new slot), frees and donation
        cleared for the caller to redo, and ``changes`` applied. A passes' rebuild of whole programs:
        ``dataclasses.replace`` re-runs ``__init__`` and costs several times more."""
        copy = self.copy(out=new[self.out], args=tuple(new[a] for a in self.args), free=(), donate=-1)
        copy.__dict__.update(changes)
        return copy

    def copy(self, **changes) -> "Instr":
        """A copy with ``changes`` (fields by name) applied: ``dataclasses.replace`` without re-running
        ``__init__``."""
        copy = object.__new__(Instr)
        copy.__dict__.update(self.__dict__, **changes)
        return copy


@dataclass(frozen=True)
class LiveBuffer:
    """One buffer live at a program's peak (``SPMDProgram.peak_breakdown``): its bytes, the loops it is inside
    (``where``: "%12 scan > " for a body of the scan at slot 12; "" at top level), what made it (an input or an
    instruction), its local type, the user's name if any, and ``origin``: the slot whose buffer it is (a result
    written in place into an operand keeps the operand's)."""
    nbytes: int
    where: str
    what: str
    type: str
    name: str = ""
    origin: int = -1

    def __repr__(self):
        return f"{self.nbytes / 2 ** 30:.3f} GiB  {self.where}{self.what} {self.type} {self.name}".rstrip()


@dataclass
class IOSpec:
    name: str
    slot: int
    shape: tuple[int, ...]  # global
    dtype: str
    sharding: Sharding

    def at(self, slot: int) -> "IOSpec":
        """This input or output at ``slot`` (a pass renumbered the program)."""
        return IOSpec(self.name, slot, self.shape, self.dtype, self.sharding)


@dataclass
class SPMDProgram:
    mesh: Mesh
    instrs: list[Instr]
    inputs: list[IOSpec]
    outputs: list[IOSpec]
    notes: list[str] = field(default_factory=list)
    report: dict = field(default_factory=dict, repr=False)  # value -> (sharding, origin); not saved
    in_tree: object = field(default=None, repr=False)  # pytree structures of the traced function; not saved
    out_tree: object = field(default=None, repr=False)
    names: dict = field(default_factory=dict, repr=False)  # slot -> the user's name (mesh_split(name=...))
    cost_model: CostModel = field(default=DEFAULT_MODEL, repr=False, compare=False)  # prices collectives; not saved

    # ------------------------------------------------------------ summaries
    def comm_summary(self, cost_model: CostModel | None = None) -> list[dict]:
        """One dict per collective: kind, axes, group_size, bytes_in, bytes_out, wire_bytes (per rank) and
        predicted_s, its time under ``cost_model`` (default: the program's own, a calibrated profile or else
        the default link). A collective inside a loop body appears once, with ``trips`` (iterations of a
        scan; 1 for a while loop or cond, whose count is known only at run time) and its wire bytes and
        predicted seconds multiplied by them; bodies are priced with the enclosing program's model."""
        model = self.cost_model if cost_model is None else cost_model
        sizes = {i.out: i.nbytes for i in self.instrs}
        out = []
        for ins in self.instrs:
            kind = collective_kind(ins.op)  # a start/done pair counts once, at its start
            if kind and ins.attrs.get("axes", True):  # axes (): an exchange kept home
                k = group_size(kind, ins.attrs, self.mesh)
                b_in = sizes[ins.args[0]]
                sent = ins.attrs.get("wire_bytes")
                out.append({"kind": kind, "axes": tuple(ins.attrs.get("axes", self.mesh.axis_names)),
                            "group_size": k, "bytes_in": b_in, "bytes_out": ins.nbytes,
                            "wire_bytes": wire_bytes(kind, k, b_in, ins.nbytes, sent),
                            "predicted_s": model.seconds(kind, k, b_in, ins.nbytes, sent)})
            for body in _bodies(ins):
                trips = ins.attrs.get("length", 1)
                out += [{**c, "trips": c.get("trips", 1) * trips, "wire_bytes": c["wire_bytes"] * trips,
                         "predicted_s": c["predicted_s"] * trips} for c in body.comm_summary(model)]
        return out

    def estimate(self, hardware, rank: int = 0):
        """This program's predicted call on ``hardware`` (a ``Hardware``, a shipped profile's name or a profile
        file) as ``rank`` runs it: step time, compute, exposed communication, peak bytes against the device's
        memory (``spmd_runtime/estimate.py``)."""
        return estimate(self, hardware if isinstance(hardware, Hardware) else Hardware.load(hardware), rank)

    @property
    def wire_bytes(self) -> float:
        return sum(c["wire_bytes"] for c in self.comm_summary())

    def collectives(self) -> list[str]:
        """Collective kinds in program order (handy in tests)."""
        return [c["kind"] for c in self.comm_summary()]

    def input_bytes(self) -> list[int]:
        return [int(np.prod(i.sharding.local_shape(i.shape, self.mesh))) * np.dtype(i.dtype).itemsize
                for i in self.inputs]

    def output_bytes(self) -> list[int]:
        return [int(np.prod(o.sharding.local_shape(o.shape, self.mesh))) * np.dtype(o.dtype).itemsize
                for o in self.outputs]

    def peak_bytes(self) -> int:
        """Largest sum of live local buffers at any point, inputs included: the caller holds an input for the
        whole run unless it is donated (then it is freed, or reused, where it dies); a result written into a
        dying operand (``donate``) takes no new buffer, nor does a view of its operand (a transpose, a reshape
        NumPy does without a copy: ``layouts.py``), which keeps that buffer alive (``live_buffers.py``)."""
        heap = LiveBuffers(self)
        peak = cur = heap.held
        for ins in self.instrs:
            for body in _bodies(ins):  # a loop's temporaries live while it runs
                peak = max(peak, cur + body.peak_bytes() - sum(body.input_bytes()) + _loop_bytes(ins))
            if ins.op != PARAMETER.name:  # inputs are counted above
                cur += heap.add(ins)
                peak = max(peak, cur)
            cur -= heap.free(ins.free)
        return peak

    def peak_breakdown(self, top: int | None = None) -> list["LiveBuffer"]:
        """What is live where ``peak_bytes`` peaks, biggest first (the first ``top``; all when None): the inputs
        held, the live buffers (each once, named by the last value written into it in place), and, when the peak
        is inside a loop, the loop body's live buffers (``where`` names the loop), the ys it stacks and the
        carries it copies. Their bytes sum to ``peak_bytes()`` (a body's inputs are its loop's operands, counted
        once, outside). Walks ``peak_bytes``'s accounting a second time and stops where it first reaches the
        peak."""
        found = self._live_at(self.peak_bytes(), "")
        return sorted(found, key=lambda b: -b.nbytes)[:top]

    def _live_at(self, target: int, where: str) -> list["LiveBuffer"]:
        """The live buffers where the walk of ``peak_bytes`` first totals ``target`` bytes."""
        heap = LiveBuffers(self)
        cur = heap.held
        donated = {self.inputs[k].slot for k in self.donated}
        by_slot = {i.slot: LiveBuffer(n, where, f"input {i.name}", _ty(i.dtype, i.sharding.local_shape(i.shape, self.mesh)),
                                      origin=i.slot) for i, n in zip(self.inputs, self.input_bytes())}
        held = lambda: [by_slot[i.slot] for i in self.inputs if i.slot not in donated] + [
            replace(by_slot[b], nbytes=n) for b, n in heap.size.items()]
        if cur >= target:
            return held()
        for ins in self.instrs:
            for body in _bodies(ins):
                inner = body.peak_bytes() - sum(body.input_bytes())
                if cur + inner + _loop_bytes(ins) >= target:
                    inside = f"{where}%{ins.out} {ins.op} > "
                    own = {i.slot for i in body.inputs}
                    found = [b for b in body._live_at(body.peak_bytes(), inside) if b.where != inside or b.origin not in own]
                    rest = inner - sum(b.nbytes for b in found)  # negative: inputs the body freed before its peak
                    extra = [LiveBuffer(_stacked_bytes(ins), inside, "stacked ys", "")] if _stacked_bytes(ins) else []
                    extra += [LiveBuffer(_copied_carry_bytes(ins), inside, "carries the loop copies", "")] \
                        if _copied_carry_bytes(ins) else []
                    extra += [LiveBuffer(rest, inside, "body inputs freed before its peak", "")] if rest else []
                    return held() + found + extra
            if ins.op != PARAMETER.name:
                cur += heap.add(ins)
                buffer = heap.buffer_of(ins.out)
                if buffer == ins.out or ins.donate >= 0 and buffer == heap.buffer_of(ins.args[ins.donate]):
                    by_slot[buffer] = LiveBuffer(ins.nbytes, where, f"%{ins.out} {ins.op}", _ty(ins.dtype, ins.shape),
                                                 self.names.get(ins.out, ""), buffer)  # named by its last writer
                if cur >= target:
                    return held()
            cur -= heap.free(ins.free)
        raise AssertionError(f"peak walk never reached {target} bytes")  # peak_bytes and _live_at disagree

    # ------------------------------------------------------------ listing
    @property
    def donated(self) -> frozenset:
        """Positions of the inputs whose buffers the program may overwrite (``partition(donate=...)``)."""
        if "_donated" not in self.__dict__:
            self.__dict__["_donated"] = frozenset(i.attrs["index"] for i in self.instrs
                                                  if i.op == PARAMETER.name and i.attrs.get("donated"))
        return self.__dict__["_donated"]

    @property
    def written_inputs(self) -> frozenset:
        """Positions of the donated inputs some instruction writes its result into (``Instr.donate``), or a loop
        runs in (its ``adopt``). Not cached: a pass that redoes the donations changes it."""
        donated = {i.out: i.attrs["index"] for i in self.instrs if i.op == PARAMETER.name and i.attrs.get("donated")}
        written = [i.args[i.donate] for i in self.instrs if i.donate >= 0]
        written += [i.args[k] for i in self.instrs for k in i.attrs.get("adopt", ())]  # a loop runs in its buffer
        return frozenset(donated[s] for s in written if s in donated)

    def __str__(self):
        head = f"SPMDProgram on {self.mesh}  hash={self.hash[:12]}  wire_bytes/rank={self.wire_bytes:.0f}"
        params = ", ".join(f"%{i.slot} {i.name}: {_ty(i.dtype, i.shape)} {i.sharding}"
                           f"{' donated' if k in self.donated else ''}" for k, i in enumerate(self.inputs))
        lines = [head, f"  inputs ({params})"] + self._listing("  ")
        lines += [f"  # note: {n}" for n in self.notes]
        return "\n".join(lines)

    def _listing(self, indent: str) -> list[str]:
        """Instructions and the return line; a loop's body follows it, nested (like HLO's while)."""
        lines = []
        for ins in self.instrs:
            if ins.op == PARAMETER.name:
                continue
            attrs = ", ".join(f"{k}={_fmt(v)}" for k, v in ins.attrs.items() if not _is_program(v))
            args = ", ".join(f"%{a}" + ("!" if k == ins.donate else "") for k, a in enumerate(ins.args))
            sep = ", " if args and attrs else ""
            ty = "tuple" if _bodies(ins) else f"{_ty(ins.dtype, ins.shape)} {ins.sharding}"
            comment = [self.names[ins.out]] if ins.out in self.names else []
            comment += [source_line(ins.source)] if ins.source else []
            name = f"  # {'  '.join(comment)}" if comment else ""
            lines.append(f"{indent}%{ins.out} = {ins.op}({args}{sep}{attrs}) : {ty}{name}")
            for name, v in ins.attrs.items():
                for k, body in enumerate(v if isinstance(v, tuple) else (v,)):
                    if _is_program(body):
                        params = ", ".join(f"%{i.slot}: {_ty(i.dtype, i.sharding.local_shape(i.shape, self.mesh))} "
                                           f"{i.sharding}" for i in body.inputs)
                        label = name if not isinstance(v, tuple) else f"{name}[{k}]"
                        lines.append(f"{indent}  {label}({params}) {{")
                        lines += body._listing(indent + "    ")
                        lines.append(f"{indent}  }}")
        lines.append(indent + "return " + ", ".join(f"%{o.slot} {o.sharding}" for o in self.outputs))
        return lines

    # ------------------------------------------------------------ persistence
    def body(self) -> dict:
        body = {"mesh": self.mesh.to_json(),
                "inputs": [_io_json(i) for i in self.inputs], "outputs": [_io_json(o) for o in self.outputs],
                "instrs": [_instr_json(i) for i in self.instrs], "notes": list(self.notes)}
        if self.names:  # only when present: programs without names keep their hash
            body["names"] = {str(k): v for k, v in sorted(self.names.items())}
        return body

    @property
    def hash(self) -> str:
        """sha256 of the saved body; computed once (a program is not changed after partitioning)."""
        if "_hash" not in self.__dict__:
            self.__dict__["_hash"] = hashlib.sha256(json.dumps(self.body(), sort_keys=True).encode()).hexdigest()
        return self.__dict__["_hash"]

    def save(self, path) -> None:
        """Write the program as JSON with its content hash (and a keyed HMAC when ``SPMD_PROGRAM_KEY`` is set)."""
        body = self.body()
        doc = {"format": "spmd_runtime.program", "version": FORMAT_VERSION, "hash": self.hash, **body}
        sources = _sources(self)
        if sources:  # the user's lines, for listings: beside the body, not in its hash
            doc["sources"] = sources
        key = _program_key()
        if key is not None:
            doc["hmac"] = hmac.new(key, self.hash.encode(), hashlib.sha256).hexdigest()
        with open(path, "w") as f:
            json.dump(doc, f, indent=1)


class ShardingReport(dict):
    """graph value id -> (Sharding, "user" | "propagated" | "default"); also indexed by the user's names
    (parameter names, ``mesh_split(..., name=...)``): ``program.report["w1"]``."""

    def __init__(self, entries, names=None):
        super().__init__(entries)
        self.names = dict(names or {})

    def __missing__(self, key):
        if isinstance(key, str) and key in self.names:
            return self[self.names[key]]
        raise KeyError(f"a report is indexed by value id or by a name in {sorted(self.names)}; got {key!r}")

    def __str__(self):
        ids = {v: k for k, v in self.names.items()}
        return "\n".join(f"%{i}{' ' + ids[i] if i in ids else ''}: {s} ({origin})" for i, (s, origin) in self.items())


def load_program(path) -> SPMDProgram:
    """Read a saved program, checking its format version, content hash and every instruction.

    The hash is an integrity check, not authentication (whoever can edit the file can recompute it), so the
    instructions are also validated against the op definitions (``program_check``). On shared clusters set
    ``SPMD_PROGRAM_KEY`` (the same secret when saving and loading): the file then carries an HMAC-SHA256 of its
    hash under that key, and a file without a matching one is refused.
    """
    with open(path) as f:
        doc = json.load(f)
    if doc.get("format") != "spmd_runtime.program" or doc.get("version") != FORMAT_VERSION:
        raise ValueError(f"a program file has format spmd_runtime.program version {FORMAT_VERSION}; got "
                         f"{doc.get('format')!r} version {doc.get('version')!r} in {path}")
    prog = _program_from(doc)
    _read_sources(prog, doc.get("sources"))
    if prog.hash != doc["hash"]:
        raise ValueError(f"a program file's content must match its hash; got {prog.hash[:12]} for recorded "
                         f"{doc['hash'][:12]} in {path} (edited or corrupt)")
    key = _program_key()
    if key is not None:
        want = hmac.new(key, prog.hash.encode(), hashlib.sha256).hexdigest()
        if not isinstance(doc.get("hmac"), str) or not hmac.compare_digest(want, doc["hmac"]):
            raise ValueError(f"with SPMD_PROGRAM_KEY set, a program file must carry an HMAC made with that key; "
                             f"got {'none' if 'hmac' not in doc else 'a different one'} in {path}")
    check_program(prog)
    return prog


def _sources(prog: SPMDProgram, prefix: str = "") -> dict:
    """{"slot" or "slot.body/slot...": [file, line]}: the user's lines of a program's instructions and its
    bodies' (a loop body's instructions under its instruction's slot and the body's position)."""
    out = {}
    for ins in prog.instrs:
        if ins.source:
            out[f"{prefix}{ins.out}"] = list(ins.source)
        for k, body in enumerate(_bodies(ins)):
            out.update(_sources(body, f"{prefix}{ins.out}.{k}/"))
    return out


def _read_sources(prog: SPMDProgram, sources, prefix: str = "") -> None:
    """The saved user's lines back on their instructions (display only: anything malformed is ignored)."""
    if not isinstance(sources, dict):
        return
    for ins in prog.instrs:
        s = sources.get(f"{prefix}{ins.out}")
        if isinstance(s, list) and len(s) == 2 and isinstance(s[0], str) and type(s[1]) is int:
            ins.source = (s[0], s[1])
        for k, body in enumerate(_bodies(ins)):
            _read_sources(body, sources, f"{prefix}{ins.out}.{k}/")


def _program_key() -> bytes | None:
    key = os.environ.get("SPMD_PROGRAM_KEY")
    return key.encode() if key else None


def _program_from(doc) -> SPMDProgram:
    return SPMDProgram(Mesh.from_json(doc["mesh"]), [_instr_from(d) for d in doc["instrs"]],
                       [_io_from(d) for d in doc["inputs"]], [_io_from(d) for d in doc["outputs"]], doc["notes"],
                       names={int(k): v for k, v in doc.get("names", {}).items()})


def _is_program(v) -> bool:
    return isinstance(v, SPMDProgram)


def _bodies(ins: Instr) -> list[SPMDProgram]:
    """The body programs a control instruction (scan / while / cond) holds."""
    return [b for v in ins.attrs.values() for b in (v if isinstance(v, tuple) else (v,)) if _is_program(b)]


def _loop_bytes(ins: Instr) -> int:
    """What a loop holds beside its operands and its body's temporaries while it runs."""
    return _stacked_bytes(ins) + _copied_carry_bytes(ins)


def _copied_carry_bytes(ins: Instr) -> int:
    """The loop's own copies of the carries its body writes in place, made from their initial values (which
    stay live beside them) unless it adopts them (exec/loops.py ``_OwnCarries``)."""
    body = ins.attrs.get("body")
    if ins.op not in (SCAN.name, WHILE.name) or body is None:
        return 0
    adopted, sizes = set(ins.attrs.get("adopt", ())), body.input_bytes()
    return sum(sizes[k] for k in body.written_inputs if k < ins.attrs["num_carry"] and k not in adopted)


def _stacked_bytes(ins: Instr) -> int:
    """The stacked ys a scan fills while it runs."""
    body = ins.attrs.get("body")
    if ins.op != SCAN.name or body is None:
        return 0
    return sum(ins.attrs["length"] * n for n in body.output_bytes()[ins.attrs["num_carry"]:])


def source_line(source) -> str:
    """``model.py:12`` for a (file, line) source."""
    return f"{os.path.basename(source[0])}:{source[1]}"


def _ty(dtype, shape):
    return f"{dtype}[{','.join(map(str, shape))}]"


def _fmt(v):
    if isinstance(v, np.ndarray):
        return f"array{list(v.shape)}" if v.size > 4 else str(v.tolist())
    if isinstance(v, tuple):
        return "(" + ",".join(map(str, v)) + ")"
    return str(v)


def _io_json(i: IOSpec):
    return {"name": i.name, "slot": i.slot, "shape": list(i.shape), "dtype": i.dtype, "sharding": i.sharding.to_json()}


def _io_from(d) -> IOSpec:
    return IOSpec(d["name"], d["slot"], tuple(d["shape"]), d["dtype"], Sharding.from_json(d["sharding"]))


def _instr_json(i: Instr):
    return {"op": i.op, "out": i.out, "args": list(i.args), "attrs": {k: _enc(v) for k, v in i.attrs.items()},
            "shape": list(i.shape), "dtype": i.dtype, "sharding": i.sharding.to_json(),
            "global_shape": list(i.global_shape), "free": list(i.free), "donate": i.donate}


def _instr_from(d) -> Instr:
    return Instr(d["op"], d["out"], tuple(d["args"]), {k: _dec(v) for k, v in d["attrs"].items()},
                 tuple(d["shape"]), d["dtype"], Sharding.from_json(d["sharding"]), tuple(d["global_shape"]),
                 tuple(d["free"]), d["donate"])


def _enc(v):
    """JSON form of an attribute: arrays as base64 .npy (exact, complex ones too), complex numbers as
    ``{"complex": [real, imag]}``, NumPy scalars as Python numbers, tuples as lists; anything else JSON has no
    form for is refused naming it."""
    if isinstance(v, SPMDProgram):  # a loop body, stored once
        return {"program": v.body()}
    if isinstance(v, np.ndarray):
        buf = io.BytesIO()
        if v.dtype.kind == "V":  # ml_dtypes (bfloat16): .npy knows only raw bytes; store bits and the name
            np.save(buf, v.view(f"u{v.dtype.itemsize}"), allow_pickle=False)
            return {"ndarray": base64.b64encode(buf.getvalue()).decode(), "dtype": v.dtype.name}
        np.save(buf, v, allow_pickle=False)
        return {"ndarray": base64.b64encode(buf.getvalue()).decode()}
    if isinstance(v, (tuple, list)):
        return [_enc(x) for x in v]
    if isinstance(v, np.generic) and not isinstance(v, np.void):
        v = v.item()
    if isinstance(v, complex):
        return {"complex": [v.real, v.imag]}
    if v is not None and not isinstance(v, (bool, int, float, str)):
        raise TypeError(f"a program attribute must be a number, string, array, tuple or program to be saved; "
                        f"not supported: {type(v).__name__} {v!r}")
    return v


def _dec(v):
    if isinstance(v, dict) and "program" in v:
        return _program_from(v["program"])
    if isinstance(v, dict) and "complex" in v:
        parts = v["complex"]
        if not (isinstance(parts, list) and len(parts) == 2 and all(isinstance(p, (int, float)) and
                                                                     not isinstance(p, bool) for p in parts)):
            raise ValueError(f"a complex attribute is [real, imag]; got {parts!r}")
        return complex(*parts)
    if isinstance(v, dict) and "ndarray" in v:
        value = load_npy(io.BytesIO(base64.b64decode(v["ndarray"])))
        if "dtype" in v:
            want = parse_dtype(v["dtype"])
            if want not in LOW_PRECISION or want.itemsize != value.dtype.itemsize:
                raise ValueError(f"an array attribute's dtype must be a 16-bit float; got {v['dtype']!r}")
            value = value.view(want)
        return value
    if isinstance(v, list):
        return tuple(_dec(x) for x in v)
    return v
