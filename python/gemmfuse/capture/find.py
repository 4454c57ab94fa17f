"""Finding chains in a graph: a Linear and the stages that follow it, grown while each next
node is a fusable stage whose inputs come from outside the chain."""
from __future__ import annotations

from typing import Callable, Optional

import torch
import torch.fx as fx

from .values import AttrRef, TInfo, node_info
from .chain import CaptureReport, Chain, Unsupported
from .classify import _Ctx, classify
from .linear_forms import linear_parts, product_form
from ..tensor_parallel import dynamo_reason, is_dtensor, row_parallel_end

# --------------------------------------------------------------------------------------------
# Finding chains.


def _attr_tensor(gm: fx.GraphModule, q: str):
    obj = gm
    for part in q.split("."):
        obj = getattr(obj, part)
    return obj


def _shape_of_source(gm, src):
    """A source's shape; a DTensor's local one (a tensor-parallel chain runs on its shard)."""
    if isinstance(src, AttrRef) or src.op == "get_attr":
        t = _attr_tensor(gm, src.qualname if isinstance(src, AttrRef) else src.target)
        if is_dtensor(t):
            t = t._local_tensor
        return tuple(t.shape) if isinstance(t, torch.Tensor) else None
    inf = node_info(src)
    return tuple(inf.shape) if isinstance(inf, TInfo) else None


def find_chains(gm: fx.GraphModule, flavor: str = "fx", check: Optional[Callable] = None,
                numbers: Optional[dict] = None) -> CaptureReport:
    """Every chain in ``gm``. ``check(spec) -> reason`` (the C++ parser), when given, vets each
    spec; a spec it refuses is reported in ``rejected`` and not returned as a chain.
    ``numbers``: graph nodes that compute a number at run time, with its value at compile time
    (``compile_time_numbers``); a chain may hold them as constants, guarded (Chain.guards)."""
    report = CaptureReport(flavor=flavor)
    order = {n: i for i, n in enumerate(gm.graph.nodes)}
    taken: set = set()
    for node in list(gm.graph.nodes):
        if node in taken:
            continue
        try:
            parts = linear_parts(node, gm)
        except Unsupported as e:
            report.rejected.append((node.name, str(e)))
            continue
        if parts is None:
            form = product_form(node)
            if form:
                report.products.append((node.name, form))
            continue
        chain, why = _start_chain(gm, node, parts, flavor, len(report.chains))
        if why:
            report.rejected.append((node.name, why))
            continue
        _grow(chain, gm, order, numbers, taken)
        _bias_from_first_add(chain)
        chain.finish()
        bad = _refused_spec(chain, check)
        if bad:
            report.rejected.append((node.name, f"spec refused by the parser: {bad}"))
            continue
        taken.update(chain.nodes)
        report.chains.append(chain)
    return report


def _start_chain(gm: fx.GraphModule, node: fx.Node, parts, flavor: str, index: int):
    """(the chain that starts at the Linear `node`, ''), or (None, why it cannot start):
    unknown shapes, a 0-d input, a bias that is not one value per output (F.linear
    broadcasts it; the fused op reads one per output), or a dynamo graph's reason."""
    x, w, b = parts.x, parts.weight, parts.bias
    why = dynamo_reason(x, w) if flavor != "fx" else ""
    if why:
        return None, why
    wshape = _shape_of_source(gm, w)
    if wshape is None or len(wshape) != 2:
        return None, f"linear weight shape unknown or not 2-d ({wshape})"
    xinf, lin_inf = node_info(x), node_info(node)
    if not isinstance(lin_inf, TInfo) or not isinstance(xinf, TInfo):
        return None, "no shape information for the linear's input/output"
    if xinf.rank < 1:
        return None, "0-d input"
    n_out, k_in = (wshape[1], wshape[0]) if parts.weight_kn else (wshape[0], wshape[1])
    bshape = _shape_of_source(gm, b) if b is not None else (n_out,)
    if bshape is None or tuple(bshape) != (n_out,):
        return None, (f"bias of shape {bshape} is not one value per output ({n_out}): it "
                      f"broadcasts, PyTorch runs it")
    return Chain(index=index, linear=node, x=x, weight=w, bias=b, in_features=int(k_in),
                 out_features=int(n_out), linear_module=parts.module, weight_kn=parts.weight_kn,
                 form=parts.form), ""


def _refused_spec(chain: Chain, check: Optional[Callable]) -> str:
    """The C++ parser's reason for refusing one of the chain's specs ('' where it takes all)."""
    if check is None:
        return ""
    for flags in chain.flag_combos():
        reason = check(chain.spec(flags))
        if reason:
            return reason
    return ""


def _grow(chain: Chain, gm: fx.GraphModule, order: dict, numbers: Optional[dict] = None,
          taken: frozenset = frozenset()):
    """Extend the chain stage by stage from its Linear along each value's first user (in
    graph order) while classify takes it, then cut it back to where no value but the last
    is used outside; chain.stop says why it ends."""
    lin = chain.linear
    chain.values = {lin: 0}
    row_parallel = row_parallel_end(gm, chain)
    if row_parallel:  # the product alone: the all-reduce, then the bias (tensor_parallel.py)
        chain.stop, chain.bias = row_parallel, None
        return
    chain_nodes = {lin}
    ctx = _Ctx(gm, chain, chain_nodes, {}, numbers)
    ctx.rank = node_info(lin).rank
    ctx.width = chain.out_features
    while True:
        cur = ctx.cur
        nxt, stop = _next_user(cur, order, chain_nodes, taken)
        if nxt is None:
            break
        try:
            stage = classify(nxt, ctx)
        except Unsupported as e:
            stop = f"{nxt.name}: {e}"
            break
        stage.input_node = cur
        chain.stages.append(stage)
        chain_nodes.update(stage.nodes)
        vnode = stage.value_node
        _track_value(chain, ctx, stage, cur, vnode)
        inf = node_info(vnode)
        if isinstance(inf, TInfo) and inf.rank != ctx.rank:
            # Our bookkeeping disagrees with the graph's metadata: stop before this stage.
            chain.stages.pop()
            for n in stage.nodes:
                chain_nodes.discard(n)
                chain.values.pop(n, None)
            stop = f"{nxt.name}: rank bookkeeping mismatch"
            break
        ctx.cur = vnode
    chain.stop = stop
    _keep_private_prefix(chain)


def _next_user(cur, order: dict, chain_nodes: set, taken: frozenset):
    """(the node the chain would take next, "") or (None, why the chain ends at cur)."""
    users = sorted(cur.users, key=lambda n: order.get(n, 1 << 30))
    if not users:
        return None, f"{cur.name} is not used"
    nxt = users[0]
    if nxt.op == "output":
        return None, f"{cur.name} is the graph's output"
    if nxt in chain_nodes:  # cannot happen in a DAG, but be safe
        return None, f"{nxt.name} already in the chain"
    if nxt in taken:  # e.g. two chains that meet: the earlier one holds the meeting node
        return None, f"{nxt.name} belongs to an earlier chain"
    return nxt, ""


def _track_value(chain: Chain, ctx: _Ctx, stage, cur, vnode) -> None:
    """The new stage's value id, and the width and rank after it (reductions, pooling)."""
    op_line = next((v for v in stage.variants.values() if v is not None), None)
    if op_line is None:  # an identity: the value keeps its input's id
        chain.values[vnode] = chain.values[cur]
        return
    chain.values[vnode] = len(chain.stages)
    op, keys = op_line
    if op in ("sum", "mean", "max", "min", "logsumexp"):
        if keys.get("keepdim", True):
            ctx.width = 1
        else:
            ctx.rank -= 1
            ctx.has_feat = False
            ctx.width = 0
    elif op in ("avg_pool", "max_pool"):
        inf = node_info(vnode)
        if isinstance(inf, TInfo) and inf.rank >= 1:
            ctx.width = int(inf.shape[-1])


def _keep_private_prefix(chain: Chain) -> None:
    """Every value but the last must be used only inside the chain: keep the longest prefix
    for which that holds."""
    while chain.stages:
        inside = set(chain.nodes)
        last = chain.output
        bad = next(((n, u) for n in inside if n is not last for u in n.users if u not in inside),
                   None)
        if bad is None:
            break
        removed = chain.stages.pop()
        for n in removed.nodes:
            chain.values.pop(n, None)
        chain.stop = f"{bad[0].name} is also used by {bad[1].name}, outside the chain"


def _bias_from_first_add(chain: Chain):
    """A Linear without a bias followed by `+ b` with a 1-d tensor of N values (`x @ W.t() + b`)
    is a Linear with that bias: the add becomes the Linear's bias, not a row-pass stage."""
    if chain.bias is not None or not chain.stages:
        return
    st = chain.stages[0]
    line = st.variants.get(None) if st.mode_module is None else None
    if not line or line[0] != "add" or set(line[1]) != {"b"} or line[1]["b"].kind != "t":
        return
    src = line[1]["b"].value
    inf = node_info(src) if isinstance(src, fx.Node) else None
    out = node_info(chain.linear)
    if (isinstance(inf, TInfo) and isinstance(out, TInfo) and inf.shape == (chain.out_features,)
            and inf.dtype == out.dtype):
        chain.bias = src
        st.variants = {None: None}  # the add's value is the Linear's


def compile_time_numbers(gm: fx.GraphModule, example_inputs) -> dict:
    """The numbers of a dynamo graph that are inputs rather than constants, with their values
    in this compilation's (real) example inputs: torch.compile(dynamic=True) passes float
    attributes and arguments (a BatchNorm's eps, a clamp bound, a scale) as 0-d CPU tensors
    that the graph reads with ``.item()``, or as float placeholders, and dynamo does not
    recompile when they change. Maps each ``.item()`` node (or float placeholder) to its value."""
    placeholders = [n for n in gm.graph.nodes if n.op == "placeholder"]
    out = {}
    for ph, v in zip(placeholders, example_inputs):
        if isinstance(v, float):
            out[ph] = v
        elif (type(v) is torch.Tensor and v.dim() == 0 and v.is_floating_point()
              and v.device.type == "cpu" and not v.requires_grad):
            for u in ph.users:
                if u.op == "call_method" and u.target == "item" and len(u.args) == 1 and not u.kwargs:
                    out[u] = float(v.item())
    return out


def capture_spec_texts(gm: fx.GraphModule, flavor: str = "fx") -> list:
    """Convenience: the spec text of every chain at the graph's current training flags."""
    rep = find_chains(gm, flavor)
    out = []
    for c in rep.chains:
        flags = tuple(gm.get_submodule(q).training for q in c.mode_modules)
        out.append(c.spec(flags))
    return out
