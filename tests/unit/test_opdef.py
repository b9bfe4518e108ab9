"""The op-definition floor: every registered op is one record with a rule in each layer's table its kind needs."""
import ast
import pathlib

import pytest

import spmd_runtime as sr
from spmd_runtime import opdef
from spmd_runtime.autodiff.rules.table import VJP
from spmd_runtime.exec.rules.table import BIND
from spmd_runtime.opdef import OPS
from spmd_runtime.partition.rules.table import PARTITION, PROPAGATION

PACKAGE = pathlib.Path(sr.__file__).parent


def missing_parts(record) -> list[str]:
    """The parts ``record``'s kind requires that neither the record (its kernel) nor the layers' rule tables
    hold."""
    runs = record.kernel or BIND.get(record)
    if record.kind == "program":
        return [] if runs else ["kernel or bind"]
    need = {"propagation": PROPAGATION.get(record), "partition": PARTITION.get(record), "vjp": VJP.get(record),
            "kernel": runs}
    return [part for part, value in need.items() if value is None]


@pytest.mark.parametrize("name", sorted(OPS))
def test_every_registered_op_has_every_part_its_kind_needs(name):
    record = OPS[name]
    assert record.name == name and record.kind in opdef.KINDS
    assert missing_parts(record) == [], f"op {name!r} ({record.kind}) lacks {missing_parts(record)}"
    if record.kind == "graph":
        assert PROPAGATION.get(record).level in (opdef.ELEMENTWISE_LEVEL, opdef.BROADCAST_LEVEL, opdef.DOT_LEVEL)


def test_buffer_flags_are_consistent():
    for record in OPS.values():
        assert not (record.fresh and record.read_only), record
        if record.ufunc or record.in_place:  # donation writes the result into a dying operand's own buffer
            assert record.fresh, record
        if record.ufunc:
            assert record.in_place, record
        if record.collective:
            assert record.kind == "program" and BIND.get(record) is not None, record


def test_an_op_is_defined_once_and_has_one_of_each_part():
    with pytest.raises(ValueError, match="defined once.*'add'"):
        opdef.define("add")
    with pytest.raises(ValueError, match="one kernel.*'add'"):
        opdef.kernel("add")(lambda xp, a, b: a)
    for table in (PROPAGATION, PARTITION, VJP):
        with pytest.raises(ValueError, match=f"one {table.part} rule.*'add'"):
            table.register("add", value=lambda *args: None)
    with pytest.raises(ValueError, match="one bind rule.*'all_reduce'"):
        BIND.register("all_reduce", value=lambda *args: None)


def test_records_know_no_rules():
    """A record holds identity, buffer flags and its kernel; the layers' rules live in their own tables."""
    fields = set(opdef.OpDef.__dataclass_fields__)
    assert not fields & {"propagation", "partition", "bind", "vjp"}, fields
    assert [op for op in OPS.values() if op.kind == "graph" and op not in PARTITION] == []
    with pytest.raises(NotImplementedError, match="definition.*'no_such_op'"):
        opdef.lookup("no_such_op")


def test_no_string_keyed_registry_is_left_outside_the_records():
    """The layers above the floor look ops up in ``opdef.OPS``; the old registries are gone."""
    gone = {"RULES", "PARTITION_RULES", "KERNELS", "VJP_RULES", "_COLLECTIVES", "_FRESH_OPS", "_READ_ONLY_OPS",
            "UFUNC_NAMES"}
    for path in PACKAGE.rglob("*.py"):
        tree = ast.parse(path.read_text())
        names = {t.id for node in ast.walk(tree) if isinstance(node, ast.Assign) for t in node.targets
                 if isinstance(t, ast.Name)}
        assert not names & gone, f"{path.relative_to(PACKAGE)} defines {names & gone}"


def test_no_function_local_imports_except_optional_or_mpi_initialising_ones():
    """Imports sit at module top; the exceptions avoid an optional dependency (cupy) or importing mpi4py
    (which initialises MPI) where no MPI is wanted, and say so in a comment."""
    allowed = {"cupy", "cupyx", "mpi4py"}
    for path in PACKAGE.rglob("*.py"):
        tree = ast.parse(path.read_text())
        for fn in ast.walk(tree):
            if isinstance(fn, (ast.FunctionDef, ast.AsyncFunctionDef)):
                for node in ast.walk(fn):
                    if isinstance(node, (ast.Import, ast.ImportFrom)):
                        module = node.module if isinstance(node, ast.ImportFrom) else node.names[0].name
                        root = (module or "").split(".")[0]
                        assert getattr(node, "level", 0) == 0 and root in allowed, \
                            f"{path.relative_to(PACKAGE)}:{node.lineno} imports {module!r} inside {fn.name}()"


def _module_imports(path: pathlib.Path, name: str, modules) -> set[str]:
    """The package modules ``name`` (at ``path``) imports at module level: ``from P import m`` imports module
    P.m when there is one, else P itself (a package stands for what its __init__ imports)."""
    tree, package = ast.parse(path.read_text()), name if path.name == "__init__.py" else name.rpartition(".")[0]
    out = set()
    for node in tree.body:
        if isinstance(node, ast.ImportFrom) and node.level:
            base = package.rsplit(".", node.level - 1)[0] if node.level > 1 else package
            target = f"{base}.{node.module}" if node.module else base
            out |= {f"{target}.{a.name}" if f"{target}.{a.name}" in modules else target for a in node.names}
        elif isinstance(node, ast.Import):
            out |= {a.name for a in node.names if a.name.startswith("spmd_runtime")}
    return out


def test_the_package_has_no_import_cycle():
    """Module-level imports form a DAG (packages' __init__ files, which only gather, left out): no module
    relies on import order to find a half-initialised one."""
    modules = {}
    for path in PACKAGE.rglob("*.py"):
        rel = path.relative_to(PACKAGE.parent).with_suffix("")
        name = ".".join(rel.parts[:-1] if rel.name == "__init__" else rel.parts)
        modules[name] = path
    inits = {n for n, p in modules.items() if p.name == "__init__.py"}

    def edges(name, seen=()):
        out = set()
        for target in _module_imports(modules[name], name, modules):
            if target in inits and target not in seen and target != name:
                out |= edges(target, seen + (target,))  # what importing the package pulls in
            elif target in modules and target not in inits:
                out.add(target)
        return out
    graph = {n: edges(n) for n in modules if n not in inits}
    state: dict = {}

    def visit(n, stack):
        state[n] = "open"
        for m in graph[n]:
            assert state.get(m) != "open", f"import cycle: {' -> '.join(stack + [n, m])}"
            if m not in state:
                visit(m, stack + [n])
        state[n] = "done"
    for n in graph:
        if n not in state:
            visit(n, [])
