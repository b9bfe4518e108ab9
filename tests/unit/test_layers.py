"""The layering of the package, checked from the source: imports run one way (the layer order is written once,
in docs/ARCHITECTURE.md's ``layers`` block, and read from there), and no string literal names an op outside the
module that defines its record."""
import ast
import fnmatch
import pathlib
import re

import pytest

import spmd_runtime as sr
from spmd_runtime.opdef import OPS

PACKAGE = pathlib.Path(sr.__file__).parent
ARCHITECTURE = PACKAGE.parent / "docs" / "ARCHITECTURE.md"

# Op-name strings that are not op references: (module, string) -> why. Keep it short; each entry says why.
NOT_AN_OP = {
    **{(m, "reverse"): "a scan's attribute (it runs backwards), not the reverse op"
       for m in ("ops.control", "partition.loops", "exec.loops", "autodiff.rules.control")},
    **{(m, "cond"): "a while node's attribute (its condition's graph), not the cond op"
       for m in ("partition.loops", "exec.loops")},
    ("ops.manual", "all_gather"): "sr.all_gather, the function its errors name (its op is pall_gather)",
    ("ops.manual", "all_to_all"): "sr.all_to_all, the function its errors name (its op is pall_to_all)",
    ("program_check", "cond"): "a while instruction's attribute holding its condition's program",
    ("ops.slicing", "constant"): "np.pad's mode, not the constant op",
    ("ops", "reshape"): "a Tensor method's name", ("ops", "transpose"): "a Tensor method's name",
    ("ops", "cumsum"): "a Tensor method's name", ("ops", "sort"): "a Tensor method's name",
    ("models.lm", "take"): "LMConfig.embedding's option that selects the take op",
    ("data", "and"): "a word of the demo grammar",
}


def layer_order() -> list[tuple[str, list[str]]]:
    """The ``layers`` block of docs/ARCHITECTURE.md, bottom first: one line per layer, ``N name: patterns``."""
    block = re.search(r"```layers\n(.*?)```", ARCHITECTURE.read_text(), re.S)
    assert block, f"{ARCHITECTURE} needs a ```layers block (the layer order, bottom first)"
    layers = []
    for line in block.group(1).splitlines():
        number, name, patterns = re.match(r"\s*(\d+)\s+([^:]+):\s*(.*)", line).groups()
        assert int(number) == len(layers), f"layers are numbered from 0 in order; got {line!r}"
        layers.append((name.strip(), patterns.split()))
    return layers


def modules() -> dict[str, pathlib.Path]:
    out = {}
    for path in PACKAGE.rglob("*.py"):
        rel = path.relative_to(PACKAGE)
        parts = rel.with_suffix("").parts
        out[".".join(parts[:-1] if rel.name == "__init__.py" else parts) or "__init__"] = path
    return out


def layer_of(module: str, layers) -> int:
    """The layer of ``module`` (a name relative to the package, ``__init__`` for the package itself): the first pattern that
    matches it (``comm.*`` matches ``comm`` and everything below it)."""
    for k, (_, patterns) in enumerate(layers):
        for pattern in patterns:
            if fnmatch.fnmatch(module, pattern) or (pattern.endswith(".*") and module == pattern[:-2]):
                return k
    raise AssertionError(f"every module has a layer in {ARCHITECTURE.name}'s layers block; got none for "
                         f"spmd_runtime.{module} (add it to its layer's patterns)")


def imports(module: str, path: pathlib.Path, names) -> list[tuple[int, str]]:
    """(line, imported module) for every module-level package import of ``module``: ``from P import m`` imports
    P.m when that is a module, else P."""
    package = ("" if module == "__init__" else module) if path.name == "__init__.py" else module.rpartition(".")[0]
    out = []
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".") if package else []
                base = base[:len(base) - (node.level - 1)]
                target = ".".join(base + ([node.module] if node.module else []))
            elif (node.module or "").startswith("spmd_runtime"):
                target = node.module[len("spmd_runtime."):] if node.module != "spmd_runtime" else ""
            else:
                continue
            for alias in node.names:
                sub = f"{target}.{alias.name}" if target else alias.name
                out.append((node.lineno, sub if sub in names else target or "__init__"))
        elif isinstance(node, ast.Import):
            out += [(node.lineno, a.name[len("spmd_runtime."):]) for a in node.names
                    if a.name.startswith("spmd_runtime.")]
    return sorted(set(out))


def test_the_layer_block_names_every_module_once():
    layers = layer_order()
    for module in modules():
        layer_of(module, layers)


def test_imports_run_down_the_layers():
    """A module imports only modules of its own layer or lower ones; importing a package counts as importing
    its __init__ (which must obey the same rule where it lives)."""
    layers, names = layer_order(), modules()
    upward = []
    for module, path in sorted(names.items()):
        mine = layer_of(module, layers)
        for line, target in imports(module, path, names):
            theirs = layer_of(target, layers)
            if theirs > mine:
                upward.append(f"spmd_runtime.{module}:{line} ({layers[mine][0]}) imports spmd_runtime.{target} "
                              f"({layers[theirs][0]})")
    assert not upward, "imports run one way (docs/ARCHITECTURE.md); got upward imports:\n" + "\n".join(upward)


def _op_strings(tree) -> list[tuple[int, str]]:
    """(line, string) for string constants that name an op, and for ``x.endswith(s)`` / ``startswith(s)`` with an
    ``s`` that ends or starts an op's name (parsing op names instead of asking the record)."""
    out, public = [], set()
    for node in ast.walk(tree):  # a module's __all__ lists functions, some named like the op they emit
        if isinstance(node, ast.Assign) and any(isinstance(t, ast.Name) and t.id == "__all__" for t in node.targets):
            public |= {id(c) for c in ast.walk(node.value)}
    for node in ast.walk(tree):
        if id(node) in public:
            continue
        if isinstance(node, ast.Constant) and isinstance(node.value, str) and node.value in OPS:
            out.append((node.lineno, node.value))
        elif (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute)
              and node.func.attr in ("endswith", "startswith") and node.args
              and isinstance(node.args[0], ast.Constant) and isinstance(node.args[0].value, str)):
            s = node.args[0].value
            if s.startswith("_") or s.endswith("_"):
                if any(n.endswith(s) if node.func.attr == "endswith" else n.startswith(s) for n in OPS):
                    out.append((node.lineno, f"{node.func.attr}({s!r})"))
    return out


def test_no_string_names_an_op_outside_its_record():
    """Op identity is the record: code passes records (``emit(TOP_K, ...)``) and compares ``node.op`` with
    ``RECORD.name``; an op's name is written as a string only in the module that defines its record."""
    found = []
    for module, path in sorted(modules().items()):
        for line, s in _op_strings(ast.parse(path.read_text())):
            home = OPS[s].module if s in OPS else None
            if home == f"spmd_runtime.{module}" or (module, s) in NOT_AN_OP:
                continue
            found.append(f"spmd_runtime/{path.relative_to(PACKAGE)}:{line}: {s!r}"
                         + (f" (its record is in {home})" if home else ""))
    assert not found, "no string literal names an op outside its record; got:\n" + "\n".join(found)


@pytest.mark.parametrize("bad", ["from ..partition.rules import table", "from spmd_runtime.exec import runner"])
def test_an_upward_import_is_caught(bad, tmp_path):
    """The check itself can fail: an ops module importing partition or exec is reported."""
    layers = layer_order()
    path = tmp_path / "core.py"
    path.write_text(bad + "\n")
    names = {**modules(), "ops.core": path}
    [(line, target)] = imports("ops.core", path, names)
    assert layer_of(target, layers) > layer_of("ops.core", layers)


def test_a_string_naming_an_op_is_caught():
    tree = ast.parse('if ins.op == "collective_permute" or ins.op.endswith("_done"):\n    pass\n')
    assert sorted(s for _, s in _op_strings(tree)) == ["collective_permute", "endswith('_done')"]
