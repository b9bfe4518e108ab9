"""Pytrees: nested containers of arrays, flattened to a list of leaves and a structure (JAX's model).

Containers are dicts (keys sorted, as JAX does), OrderedDicts (insertion order), lists, tuples, namedtuples,
dataclasses (their ``init`` fields) and ``None`` (an empty container); every
other value is a leaf. ``register_pytree_node(cls, flatten, unflatten)`` adds a
user type: ``flatten(x) -> (children, aux)``, ``unflatten(aux, children) -> x``.

The structure (``TreeDef``) is hashable and comparable, so it can key a cache
(``sr.jit``) and be checked across ranks; leaf paths give readable names
(``params.w1``, ``layers.0.b``) for graph parameters, checkpoints and errors.
"""
from __future__ import annotations

import dataclasses
from collections import OrderedDict
from typing import Any, Callable, NamedTuple


class _NodeType(NamedTuple):
    flatten: Callable  # x -> (children, aux); children in a fixed order
    unflatten: Callable  # (aux, children) -> x
    keys: Callable  # (x, aux) -> one path key per child


_REGISTRY: dict[type, _NodeType] = {}
_KINDS: dict = {}  # type -> its _NodeType, or None for a leaf type (``_node_type``); cleared at each registration
_UNSEEN = object()


def register_pytree_node(cls: type, flatten: Callable, unflatten: Callable, keys: Callable | None = None) -> None:
    """Treat instances of ``cls`` as containers: ``flatten(x) -> (children, aux)``,
    ``unflatten(aux, children) -> x``; ``keys(x, aux)`` names the children in paths (default: 0, 1, ...)."""
    if cls in _REGISTRY:
        raise ValueError(f"a type is registered as a pytree node once; got {cls.__name__} again")
    _REGISTRY[cls] = _NodeType(flatten, unflatten, keys or (lambda x, aux: None))
    _KINDS.clear()


def _dict_flatten(d):
    keys = sorted(d, key=_sort_key)
    return [d[k] for k in keys], (type(d), tuple(keys))


def _dict_unflatten(aux, children):
    kind, keys = aux
    return kind(zip(keys, children)) if kind is dict else kind(list(zip(keys, children)))


def _sort_key(k):
    return (type(k).__name__, k) if isinstance(k, (int, float, str)) else (type(k).__name__, repr(k))


register_pytree_node(dict, _dict_flatten, _dict_unflatten, lambda d, aux: aux[1])
register_pytree_node(OrderedDict, lambda d: (list(d.values()), (OrderedDict, tuple(d))), _dict_unflatten,
                     lambda d, aux: aux[1])  # insertion order, as JAX keeps it
register_pytree_node(list, lambda x: (list(x), None), lambda aux, ch: list(ch))
register_pytree_node(tuple, lambda x: (list(x), None), lambda aux, ch: tuple(ch))
register_pytree_node(type(None), lambda x: ([], None), lambda aux, ch: None)


def _node_type(x) -> tuple[type, _NodeType] | None:
    kind = type(x)
    nt = _KINDS.get(kind, _UNSEEN)
    if nt is _UNSEEN:  # decided from the type alone, once per type (a step flattens ~100 leaves per call)
        leaf = dataclasses.is_dataclass(kind) and getattr(kind, "__pytree_leaf__", False)
        nt = _KINDS[kind] = None if leaf else _node_of_kind(kind)
    return None if nt is None else (kind, nt)


def _node_of_kind(kind: type) -> _NodeType | None:
    """How to take apart and rebuild instances of ``kind`` (None: a leaf type). From the type alone, so a
    TreeDef pickles (ranks exchange them) and rebuilds its node types on load."""
    if kind in _REGISTRY:
        return _REGISTRY[kind]
    if issubclass(kind, tuple) and hasattr(kind, "_fields"):  # namedtuple
        return _NodeType(_as_list, lambda aux, ch, k=kind: k(*ch), lambda t, aux: list(t._fields))
    if dataclasses.is_dataclass(kind):
        names = [f.name for f in dataclasses.fields(kind) if f.init]
        return _NodeType(lambda d: ([getattr(d, n) for n in names], None),
                         lambda aux, ch, k=kind: k(**dict(zip(names, ch))), lambda d, aux: names)
    return None


def _as_list(t):
    return list(t), None


class TreeDef:
    """The structure of a pytree: container types, their aux data (dict keys) and children."""
    __slots__ = ("kind", "aux", "children", "num_leaves", "_node", "_hash")

    def __init__(self, kind, aux, children, node=None):
        self.kind, self.aux, self.children = kind, aux, tuple(children)
        self._node = node if node is not None or kind is None else _node_of_kind(kind)
        self.num_leaves = 1 if kind is None else sum(c.num_leaves for c in self.children)
        self._hash = hash((kind, _hashable(aux), self.children))

    def __reduce__(self):
        return (TreeDef, (self.kind, self.aux, self.children))

    @property
    def is_leaf(self) -> bool:
        return self.kind is None

    def unflatten(self, leaves):
        """The tree of this structure with ``leaves`` in flatten order."""
        leaves = list(leaves)
        if len(leaves) != self.num_leaves:
            raise ValueError(f"a tree of structure {self} has {self.num_leaves} leaves; got {len(leaves)}")
        it = iter(leaves)
        return self._build(it)

    def _build(self, it):
        if self.kind is None:
            return next(it)
        return self._node.unflatten(self.aux, [c._build(it) for c in self.children])

    def __eq__(self, other):
        return isinstance(other, TreeDef) and self._hash == other._hash and self.kind == other.kind and \
            _hashable(self.aux) == _hashable(other.aux) and self.children == other.children

    def __hash__(self):
        return self._hash

    def __repr__(self):
        return f"PyTreeDef({_show(self)})"


def _hashable(aux):
    try:
        hash(aux)
        return aux
    except TypeError:
        return repr(aux)


def _show(t: TreeDef) -> str:
    if t.kind is None:
        return "*"
    inner = [_show(c) for c in t.children]
    if t.kind is dict:
        return "{" + ", ".join(f"{k!r}: {v}" for k, v in zip(t.aux[1], inner)) + "}"
    if t.kind is list:
        return "[" + ", ".join(inner) + "]"
    if t.kind is tuple:
        return "(" + ", ".join(inner) + ("," if len(inner) == 1 else "") + ")"
    if t.kind is type(None):
        return "None"
    return f"{t.kind.__name__}(" + ", ".join(inner) + ")"


LEAF = TreeDef(None, None, ())


def _default_is_leaf(x) -> bool:
    return False


def flatten(tree, is_leaf: Callable | None = None) -> tuple[list, TreeDef]:
    """(leaves in order, structure). ``is_leaf(x)`` may stop descent at a container (e.g. a spec tuple)."""
    leaves: list = []
    return leaves, _flatten(tree, leaves, None, is_leaf or _default_is_leaf)


def _flatten(x, leaves, paths, is_leaf, path=()):
    node = None if is_leaf(x) else _node_type(x)
    if node is None:
        leaves.append(x)
        if paths is not None:
            paths.append(path)
        return LEAF
    kind, nt = node
    children, aux = nt.flatten(x)
    keys = nt.keys(x, aux) if paths is not None else None
    keys = list(range(len(children))) if keys is None else list(keys)
    return TreeDef(kind, aux, [_flatten(c, leaves, paths, is_leaf, path + (k,)) for c, k in zip(children, keys)],
                   nt)


def flatten_with_path(tree, is_leaf: Callable | None = None) -> tuple[list[tuple[tuple, Any]], TreeDef]:
    """([(path, leaf)], structure); a path is the tuple of keys from the root (dict keys, indices, fields)."""
    leaves, paths = [], []
    tdef = _flatten(tree, leaves, paths, is_leaf or _default_is_leaf)
    return list(zip(paths, leaves)), tdef


def keystr(path: tuple, prefix: str = "") -> str:
    """A readable dotted name for a leaf path: ``params.w1``, ``layers.0.b`` (``prefix`` for the root)."""
    parts = [prefix] if prefix else []
    return ".".join(parts + [str(k) for k in path]) or "leaf"


def leaf_names(tree, prefix: str = "", is_leaf: Callable | None = None) -> list[str]:
    return [keystr(p, prefix) for p, _ in flatten_with_path(tree, is_leaf)[0]]


def named_leaves(tree, prefix: str = "", is_leaf: Callable | None = None) -> dict:
    """Dotted leaf name -> leaf (``{"params": {"w1": x}}`` -> ``{"params.w1": x}``), in flatten order."""
    return {keystr(p, prefix): leaf for p, leaf in flatten_with_path(tree, is_leaf)[0]}


def leaf_paths(treedef: TreeDef) -> list[tuple]:
    """The path of every leaf of a structure, in flatten order."""
    return [p for p, _ in flatten_with_path(treedef.unflatten(range(treedef.num_leaves)))[0]]


def unflatten(treedef: TreeDef, leaves):
    return treedef.unflatten(leaves)


def tree_map(fn: Callable, tree, *rest, is_leaf: Callable | None = None):
    """``fn`` applied leaf-wise; ``rest`` trees must have ``tree``'s structure."""
    leaves, tdef = flatten(tree, is_leaf)
    others = [flatten_like(r, tdef, "tree_map argument", is_leaf) for r in rest]
    return tdef.unflatten(fn(*xs) for xs in zip(leaves, *others))


def flatten_like(tree, treedef: TreeDef, what: str = "tree", is_leaf: Callable | None = None) -> list:
    """Leaves of ``tree``, which must have structure ``treedef``; a clear error names both otherwise. Read
    along ``treedef`` (no structure of ``tree`` built); only a tree that differs is flattened, for the error."""
    leaves: list = []
    if is_leaf is None and _leaves_like(tree, treedef, leaves):
        return leaves
    leaves, got = flatten(tree, is_leaf)
    if got != treedef:
        raise ValueError(f"{what} must have the structure {treedef}; got {got}")
    return leaves


def _leaves_like(x, t: TreeDef, leaves: list) -> bool:
    """Append the leaves of ``x`` while it has the structure ``t``; False at its first difference."""
    if t.kind is None:
        leaves.append(x)
        return _node_type(x) is None
    if type(x) is not t.kind:
        return False
    children, aux = t._node.flatten(x)
    if len(children) != len(t.children) or _hashable(aux) != _hashable(t.aux):
        return False
    return all(_leaves_like(c, sub, leaves) for c, sub in zip(children, t.children))


def broadcast_prefix(prefix, tree, is_leaf: Callable, what: str = "specs") -> list:
    """One entry of ``prefix`` per leaf of ``tree``: ``prefix`` is a tree whose leaves (``is_leaf``) each
    stand for a whole subtree of ``tree`` (JAX's in_shardings rule: ``P()`` for a whole dict of params)."""
    out: list = []
    _broadcast(prefix, tree, is_leaf, out, (), what)
    return out


def _broadcast(prefix, tree, is_leaf, out, path, what):
    if prefix is None or is_leaf(prefix):
        out.extend([prefix] * flatten(tree)[1].num_leaves)
        return
    pnode, tnode = _node_type(prefix), _node_type(tree)
    if pnode is None:
        raise TypeError(f"{what} at {keystr(path, 'root')}: a spec leaf must be a P, a Sharding or None; "
                        f"got {prefix!r}")
    pch, paux = pnode[1].flatten(prefix)
    if tnode is None or tnode[0] != pnode[0]:
        raise ValueError(f"{what} must match the arguments' structure (or be a prefix of it); got "
                         f"{type(prefix).__name__} where the argument at {keystr(path, 'root')} is "
                         f"{type(tree).__name__}")
    tch, taux = tnode[1].flatten(tree)
    if _hashable(paux) != _hashable(taux) or len(pch) != len(tch):
        raise ValueError(f"{what} must match the arguments' structure (or be a prefix of it); got "
                         f"{flatten(prefix, is_leaf)[1]} for arguments {flatten(tree)[1]} at "
                         f"{keystr(path, 'root')}")
    keys = pnode[1].keys(prefix, paux) or range(len(pch))
    for p, t, k in zip(pch, tch, keys):
        _broadcast(p, t, is_leaf, out, path + (k,), what)
