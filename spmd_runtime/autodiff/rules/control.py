"""The VJP rules of the ``ops/control.py`` family, registered in ``table.py``: a scan's is a reverse scan over
the residuals its forward scan is made to save (the machinery: ``autodiff/loops.py``), a cond's a cond whose
branches recompute and differentiate their forward pass, a ``loop_out``'s a tuple cotangent of its control
node; a while loop has none (its trip count is known only at run time)."""
from __future__ import annotations

from ...bodies import capture, inline
from ...graph import TensorSpec
from ...ops.control import CHECKPOINT_NAME, COND, LOOP_OUT, SCAN, WHILE, cond, scan
from ...trace import current_graph
from ..engine import backward_from
from ..loops import TupleCotangent, add_results, floating, linearize, zeros_like
from .table import vjp


@vjp(CHECKPOINT_NAME)
def checkpoint_name_vjp(node, g, ops, y):
    return [g]  # an identity: the name only tells a remat policy what to save


@vjp(LOOP_OUT)
def loop_out_vjp(node, g, ops, y):
    return [TupleCotangent({node.attrs["index"]: g})]


@vjp(WHILE)
def while_vjp(node, g, ops, y):
    raise NotImplementedError("reverse-mode differentiation through sr.while_loop is not supported (its trip "
                              "count is known only at run time); use sr.fori_loop or sr.scan")


@vjp(SCAN)
def scan_vjp(node, ct, operands, result):
    a = node.attrs
    nc, nx, length, body = a["num_carry"], a["num_xs"], a["length"], a["body"]
    results = a["results"]
    lin = linearize(body, nc, a["policy"])
    n_in = len(body.params)
    # the forward scan also stacks the residuals (and the carries the backward body reads)
    a["body"] = lin.forward
    stacks = add_results(result, [TensorSpec((length,) + s.shape, s.dtype) for s in lin.saved_specs])
    saved_stacks, carry_stacks = stacks[:lin.num_saved], dict(zip(lin.carries_saved, stacks[lin.num_saved:]))
    out_ct = {k: ct.parts.get(k) if ct.parts.get(k) is not None else zeros_like(results[k]) for k in lin.float_outs}

    float_carries = [i for i in lin.float_ins if i < nc]
    float_consts = [i for i in lin.float_ins if i >= nc + nx]
    float_xs = [i for i in lin.float_ins if nc <= i < nc + nx]
    sources, xs = [], []  # per backward-body input: ("xs", k) | ("const", tensor) | ("carry", k)
    for p in lin.used:
        if p < lin.num_saved:
            sources.append(("xs", len(xs)))
            xs.append(saved_stacks[p])
        elif p < lin.num_saved + n_in:
            i = p - lin.num_saved
            if i < nc + nx:
                sources.append(("xs", len(xs)))
                xs.append(carry_stacks[i] if i < nc else operands[i])
            else:
                sources.append(("const", operands[i]))
        else:
            k = lin.float_outs[p - lin.num_saved - n_in]
            if k < nc:
                sources.append(("carry", float_carries.index(k)))
            else:
                sources.append(("xs", len(xs)))
                xs.append(out_ct[k])

    def step(carry, xs_t):
        ct_c, acc = carry
        args = [xs_t[v] if kind == "xs" else ct_c[v] if kind == "carry" else v for kind, v in sources]
        grads = dict(zip(lin.float_ins, inline(lin.backward, args)))
        return ([grads[i] for i in float_carries], [s + grads[i] for s, i in zip(acc, float_consts)]), \
            [grads[i] for i in float_xs]

    init = ([out_ct[i] for i in float_carries], [zeros_like(operands[i].node.spec) for i in float_consts])
    (ct_init, ct_consts), ct_xs = scan(step, init, xs, length=length, reverse=not a["reverse"])
    got = {**dict(zip(float_carries, ct_init)), **dict(zip(float_consts, ct_consts)), **dict(zip(float_xs, ct_xs))}
    return [got.get(i) for i in range(len(operands))]


@vjp(COND)
def cond_vjp(node, ct, operands, result):
    a = node.attrs
    n, (n_false, n_true) = a["num_operands"], a["captures"]
    pred, ops = operands[0], operands[1:1 + n]
    caps = (operands[1 + n:1 + n + n_false], operands[1 + n + n_false:])
    float_res = [k for k, s in enumerate(a["results"]) if floating(s.dtype)]
    cts = [ct.parts[k] if ct.parts.get(k) is not None else zeros_like(a["results"][k]) for k in float_res]
    float_ops = [i for i, o in enumerate(ops) if floating(o.dtype)]
    float_caps = [[i for i, c in enumerate(cs) if floating(c.dtype)] for cs in caps]

    def branch_vjp(which):
        def fn(*args):
            own = [capture(t) for t in caps[which]]
            start = len(current_graph().nodes)
            outs = inline(a["branches"][which], list(args[:n]) + own)
            seeds = {}
            for k, c in zip(float_res, args[n:]):
                seeds[outs[k].id] = seeds[outs[k].id] + c if outs[k].id in seeds else c
            wrt = [args[i] for i in float_ops] + [own[i] for i in float_caps[which]]
            grads = backward_from(seeds, wrt, start)
            by_branch = [[zeros_like(caps[b][i].node.spec) for i in float_caps[b]] for b in (0, 1)]
            by_branch[which] = grads[len(float_ops):]
            return grads[:len(float_ops)] + by_branch[0] + by_branch[1]
        return fn

    grads = cond(pred, branch_vjp(1), branch_vjp(0), *ops, *cts)
    out = [None] * len(operands)
    positions = [1 + i for i in float_ops] + [1 + n + i for i in float_caps[0]] + \
        [1 + n + n_false + i for i in float_caps[1]]
    for p, g in zip(positions, grads):
        out[p] = g
    return out
