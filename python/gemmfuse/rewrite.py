"""Rewriting a graph: a captured chain's nodes become one ``_run_chain`` call whose
``ChainRuntime`` holds the chain's specs, its inputs' positions and a fallback graph of the
original nodes."""
from __future__ import annotations

import math

from dataclasses import dataclass
from typing import Any

import torch
import torch.fx as fx
import torch.nn as nn

from .capture import AttrRef, Chain, TInfo, _attr_tensor, node_info, source_key
from .runtime import ChainRuntime, _call_module, _run_chain

def _flatten_nodes(args):
    out = []
    fx.node.map_arg(args, lambda n: out.append(n))
    return out


def resolve(remap: dict, n):
    """What a node became after earlier rewrites of the same graph."""
    while isinstance(n, fx.Node) and n in remap:
        n = remap[n]
    return n


@dataclass
class Rewritten:
    node: fx.Node
    runtime: ChainRuntime
    sources: list


def chain_sources(chain: Chain, remap: dict) -> tuple:
    """The chain's inputs, each once, in a fixed order (x, W, b, operands, state and the rest,
    as the nodes read them): (sources, index by source_key)."""
    sources, index = [], {}

    def add(src):
        src = resolve(remap, src)
        k = source_key(src)
        if k not in index:
            index[k] = len(sources)
            sources.append(src)
        return index[k]

    chain_set = set(chain.nodes)
    for n in chain.nodes:
        for a in _flatten_nodes((n.args, n.kwargs)):
            if a not in chain_set:
                add(a)
        if n.op == "call_module":
            add(AttrRef(n.target))
    for src in [chain.x, chain.weight, chain.bias, *chain.operands, *chain.state]:
        if src is not None:
            add(src)
    for q in chain.mode_modules:
        add(AttrRef(q))
    for n in chain.guards:
        add(n)
    return sources, index


def chain_subgraph(chain: Chain, index: dict, remap: dict) -> fx.GraphModule:
    """The chain's own nodes as a graph of their own, every source an argument (in `index`
    order): the fallback the chain runtime runs, and the lowering the backend times."""
    fb = fx.Graph()
    ph = [fb.placeholder(f"in{i}") for i in range(len(index))]
    env = {}

    def tr(a):
        if a in env:
            return env[a]
        return ph[index[source_key(resolve(remap, a))]]

    for n in chain.nodes:
        if n.op == "call_module":
            mod_in = ph[index[source_key(AttrRef(n.target))]]
            args = fx.node.map_arg(n.args, tr)
            kwargs = fx.node.map_arg(n.kwargs, tr)
            env[n] = fb.call_function(_call_module, (mod_in,) + tuple(args), dict(kwargs))
        else:
            env[n] = fb.node_copy(n, tr)
    fb.output(env[chain.output])
    return fx.GraphModule(nn.Module(), fb, class_name="GemmfuseFallback")


def op_call(g: fx.Graph, chain: Chain, spec: str, precision: str, node_of) -> fx.Node:
    """A ``gemmfuse::run`` node for the chain in graph g, its inputs given by
    ``node_of(source)``: x contiguous, a weight stored [in, out] transposed, operands in x's
    dtype (what ChainRuntime.traced does at run time)."""
    dtype = node_info(chain.x).dtype

    def contiguous(n):
        return g.call_method("contiguous", (n,))

    x = contiguous(node_of(chain.x))
    w = node_of(chain.weight)
    if chain.weight_kn:
        w = contiguous(g.call_method("t", (w,)))
    b = node_of(chain.bias) if chain.bias is not None else None
    ops = []
    for src in chain.operands:
        n = node_of(src)
        inf = node_info(src) if isinstance(src, fx.Node) else None
        if not isinstance(inf, TInfo) or inf.dtype != dtype:
            n = g.call_method("to", (n, dtype))
        ops.append(contiguous(n))
    state = [node_of(s) for s in chain.state]
    return g.call_function(torch.ops.gemmfuse.run.default, (spec, x, w, b, ops, state, precision))


def rewrite_chain_as_op(gm: fx.GraphModule, chain: Chain, spec: str, precision: str,
                        remap: dict) -> fx.Node:
    """Replace the chain's nodes by one ``gemmfuse::run`` node (the torch.compile backend's
    form: an opaque op that Inductor and AOTAutograd take as it is)."""
    g = gm.graph
    last = chain.output
    attrs = {}

    def node_of(src):
        src = resolve(remap, src)
        if isinstance(src, AttrRef):
            if src.qualname not in attrs:
                attrs[src.qualname] = g.get_attr(src.qualname)
            return attrs[src.qualname]
        return src

    with g.inserting_before(last):
        new = op_call(g, chain, spec, precision, node_of)
    _replace(g, chain, last, new, remap)
    return new


def _replace(g: fx.Graph, chain: Chain, last: fx.Node, new: fx.Node, remap: dict) -> None:
    new.meta.update({k: v for k, v in last.meta.items()
                     if k in ("gemmfuse_info", "example_value", "val", "tensor_meta", "stack_trace")})
    last.replace_all_uses_with(new)
    remap[last] = new
    for n in reversed(chain.nodes):
        g.erase_node(n)


def rewrite_chain(gm: fx.GraphModule, chain: Chain, precision: str, remap: dict,
                  attr_name: str, rooted: bool = False) -> Rewritten:
    """Replace the chain's nodes by ``_run_chain(gm.<attr_name>, [inputs...])``. `rooted`:
    the runtime reads the modules among the inputs from gm itself (ChainRuntime.bind)."""
    g = gm.graph
    sources, index = chain_sources(chain, remap)
    rt = _chain_runtime(gm, chain, precision, remap, sources, index, rooted)
    setattr(gm, attr_name, rt)
    owned = {i for i, *_ in rt.owned} | {i for i, _ in rt.rooted}
    last = chain.output
    with g.inserting_before(last):
        getattrs = {}
        args = []
        for i, src in enumerate(sources):
            if i in owned:  # read by the runtime from its module input
                args.append(None)
            elif isinstance(src, AttrRef):
                if src.qualname not in getattrs:
                    getattrs[src.qualname] = g.get_attr(src.qualname)
                args.append(getattrs[src.qualname])
            else:
                args.append(src)
        rt_node = g.create_node("get_attr", attr_name)  # a plain attribute: skip get_attr's check
        new = g.call_function(_run_chain, (rt_node, args))
    _replace(g, chain, last, new, remap)
    return Rewritten(new, rt, sources)


def _chain_runtime(gm, chain: Chain, precision: str, remap: dict, sources: list, index: dict,
                   rooted: bool) -> ChainRuntime:
    """The runtime of one chain: its specs, where each of its inputs is in the call's list,
    its fallback graph, and what it reads from modules rather than from the graph."""
    def idx(src):
        return index[source_key(resolve(remap, src))]

    # The modules the chain replaces: their hooks send calls to the fallback.
    module_idx = [(idx(AttrRef(n.target)), n.target) for n in chain.nodes if n.op == "call_module"]
    guards = [(idx(n), v, _number_name(n)) for n, v in chain.guards.items()]
    specs = {flags: chain.spec(flags) for flags in chain.flag_combos()}
    xinf = node_info(chain.x)
    rt = ChainRuntime(chain.index, specs, idx(chain.x), idx(chain.weight),
                      idx(chain.bias) if chain.bias is not None else None,
                      [idx(s) for s in chain.operands], [idx(s) for s in chain.state],
                      [idx(AttrRef(q)) for q in chain.mode_modules],
                      list(chain.mode_modules), precision, chain_subgraph(chain, index, remap),
                      chain.in_features, xinf.rank if isinstance(xinf, TInfo) else None, guards,
                      dict(module_idx), chain.weight_kn)
    rt.example_sources = [example_record(src) for src in sources]
    rt.owned = tuple(_owned(gm, sources, index))
    if rooted:
        rt.rooted = tuple((i, src.qualname) for i, src in enumerate(sources)
                          if isinstance(src, AttrRef) and isinstance(_attr_tensor(gm, src.qualname), nn.Module))
    rt.out_features = chain.out_features
    # The nn.Linear module's input index (tensor parallel reads its hooks: tensor_parallel.py)
    rt.linear_idx = idx(AttrRef(chain.linear_module)) if chain.linear_module else None
    return rt


def _owned(gm: fx.GraphModule, sources: list, index: dict):
    """(input index, module input index, dict name, attribute, module class) for each source
    that is a parameter or buffer of a module that is itself a source (ChainRuntime.owned)."""
    for i, src in enumerate(sources):
        if not isinstance(src, AttrRef) or "." not in src.qualname:
            continue
        parent, name = src.qualname.rsplit(".", 1)
        mi = index.get(source_key(AttrRef(parent)))
        if mi is None:
            continue
        mod = gm.get_submodule(parent)
        if name in mod.__dict__ or hasattr(type(mod), name):
            continue  # shadowed (a plain attribute, a parametrization's property)
        for d in ("_parameters", "_buffers"):
            if name in mod.__dict__[d]:
                yield (i, mi, d, name, type(mod))
                break


def _number_name(node: fx.Node) -> str:
    """What a guarded number is called in messages: the graph input it is read from."""
    if node.op == "call_method" and node.target == "item" and isinstance(node.args[0], fx.Node):
        node = node.args[0]
    return node.name


def example_tensor(gm: fx.GraphModule, src) -> Any:
    """A tensor standing in for a source at describe time: real attributes, zeros otherwise
    (of the shape dynamo's graph hints at, where its sizes are symbolic)."""
    if isinstance(src, AttrRef):
        return _attr_tensor(gm, src.qualname)
    if src.op == "get_attr":
        return _attr_tensor(gm, src.target)
    inf = node_info(src)
    if isinstance(inf, TInfo):
        shape = [torch.fx.experimental.symbolic_shapes.size_hint(d) for d in inf.shape]
        return torch.zeros(shape, dtype=inf.dtype, device=inf.device)
    return None


def example_record(src):
    """What example_from_record needs to rebuild a stand-in for a source later (no fx.Node)."""
    if isinstance(src, AttrRef):
        return ("attr", src.qualname)
    if src.op == "get_attr":
        return ("attr", src.target)
    inf = node_info(src)
    return ("info", inf if isinstance(inf, TInfo) else None)


def example_from_record(gm, rec):
    kind, v = rec
    if kind == "attr":
        return _attr_tensor(gm, v)
    if v is None:
        return None
    return torch.zeros(v.shape, dtype=v.dtype, device=v.device)


def rewrite_lm_head(gm: fx.GraphModule, match, precision: str) -> fx.Node:
    """Replace an LM head's Linear and loss (capture/lm_head.py) by one
    ``gemmfuse.lm_head.linear_cross_entropy`` call: x flattened to rows as the logits were, the
    weight and bias read with get_attr where they are parameters (optimizer steps are seen)."""
    from .lm_head import linear_cross_entropy
    g, parts = gm.graph, match.parts

    def node_of(src):
        return g.get_attr(src.qualname) if isinstance(src, AttrRef) else src

    with g.inserting_before(match.loss):
        w = node_of(parts.weight)
        if parts.weight_kn:  # stored [in, out]: the op reads [V, K]
            w = g.call_method("t", (w,))
        b = node_of(parts.bias) if parts.bias is not None else None
        x, xinf = parts.x, node_info(parts.x)
        if xinf.rank != 2:
            k = match.head.in_features
            x = g.call_method("reshape", (x, -1, k))
            rows = math.prod(xinf.shape[:-1])
            x.meta["gemmfuse_info"] = TInfo((rows, k), xinf.dtype, xinf.device, xinf.requires_grad)
        new = g.call_function(linear_cross_entropy, (x, w, match.target),
                              dict(bias=b, **match.options, precision=precision))
    new.meta.update({k: v for k, v in match.loss.meta.items()
                     if k in ("gemmfuse_info", "example_value", "val", "tensor_meta", "stack_trace")})
    match.loss.replace_all_uses_with(new)
    for n in reversed(match.nodes):
        g.erase_node(n)
    return new


def fuse_lm_heads(gm: fx.GraphModule, precision: str, report) -> None:
    """Every LM head of gm (a Linear whose logits only feed a cross-entropy loss:
    capture/lm_head.py; optimize()'s graph or dynamo's, its weight an attribute or a
    placeholder) rewritten into one linear_cross_entropy call where it can be, the LMHead
    entries (fused or with the reason) in report.lm_heads. Run before the chain finder: it
    must not see their Linears. An error while matching is a reason in report.rejected, never
    an error where PyTorch alone works."""
    try:
        report.lm_heads = _fuse_heads(gm, precision)
    except Exception as e:  # noqa: BLE001
        report.rejected.append(("LM heads", f"not matched after an error: {type(e).__name__}: {e}"[:300]))
        return
    if report.fused_lm_heads():
        gm.recompile()


def _fuse_heads(gm: fx.GraphModule, precision: str) -> list:
    """fuse_lm_heads's work: the LMHead entries."""
    from . import lm_head
    from .capture.lm_head import find_lm_heads, left_unfused_on
    heads = []
    for head, match in find_lm_heads(gm):
        heads.append(head)
        if match is None:
            continue
        try:
            x = example_tensor(gm, match.parts.x)
            head.reason = left_unfused_on(x.device)
            if head.reason:
                continue
            w = example_tensor(gm, match.parts.weight)
            w = w.t() if match.parts.weight_kn else w
            b = example_tensor(gm, match.parts.bias) if match.parts.bias is not None else None
            head.plan = lm_head.describe(x, w, b, precision)
        except (RuntimeError, ValueError, AttributeError, TypeError) as e:
            head.reason = f"describe failed: {type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"
            continue
        rewrite_lm_head(gm, match, precision)
        head.status = "fused"
    return heads


def _records_grad(gm: fx.GraphModule, nodes) -> bool:
    """Whether autograd records through these values: one needs grad (dynamo's example values
    say so), or, in a graph traced by torch.fx (whose values carry no grad), the module is in
    training mode with parameters that need grad (optimize()'s module will train then)."""
    if any(getattr(node_info(t), "requires_grad", False) for t in nodes):
        return True
    return bool(getattr(gm, "training", False)) and any(p.requires_grad for p in gm.parameters())


def fuse_attention(gm: fx.GraphModule, precision: str, report, example_inputs=()) -> None:
    """Every SDPA call of gm that gemmfuse's attention kernels take (capture/attention.py)
    and that, on a GPU, timed faster there, rewritten into a
    ``gemmfuse.attention.scaled_dot_product_attention`` call; the AttentionSite entries (fused
    or with the reason) in report.attention. `example_inputs`: a dynamo graph's (a causal mask
    may be one of the module's buffers). An error while matching is a reason in
    report.rejected, never an error where PyTorch alone works."""
    from . import attention
    from .capture.attention import find_attention
    sites: list = []
    try:
        for site, match in find_attention(gm, example_inputs):
            sites.append(site)
            if match is None:
                continue
            inf = node_info(match.q)
            shape = [torch.fx.experimental.symbolic_shapes.size_hint(d) for d in site.shape]
            training = _records_grad(gm, (match.q, match.k, match.v))
            site.reason = attention.choice(shape, inf.device, site.is_causal, match.scale,
                                           training, precision, site.mask, site.kv_heads,
                                           site.kv_len)
            if not site.reason:
                _rewrite_attention(match)
                site.status = "fused"
    except Exception as e:  # noqa: BLE001
        report.rejected.append(("attention", f"not matched after an error: {type(e).__name__}: {e}"[:300]))
    report.attention = sites
    if any(s.status == "fused" for s in sites):
        gm.recompile()


def _rewrite_attention(match) -> None:
    """The SDPA call retargeted, or written-out attention's last product replaced by one call
    and its steps (and a mask only they read) erased."""
    from .attention import scaled_dot_product_attention
    node, kwargs = match.node, {"is_causal": match.site.is_causal, "scale": match.scale}
    if match.mask is not None:
        kwargs["attn_mask"] = match.mask
    if match.site.kv_heads:
        kwargs["enable_gqa"] = True
    if not match.erase:
        node.target, node.args, node.kwargs = scaled_dot_product_attention, (match.q, match.k, match.v), kwargs
        return
    g = node.graph
    with g.inserting_before(node):
        new = g.call_function(scaled_dot_product_attention, (match.q, match.k, match.v), kwargs)
    new.meta.update({k: v for k, v in node.meta.items()
                     if k in ("gemmfuse_info", "example_value", "val", "tensor_meta", "stack_trace")})
    node.replace_all_uses_with(new)
    _erase_unused([node, *match.erase])


def _erase_unused(nodes: list) -> None:
    """Erase each node no longer read, then what only it read (not graph inputs or attributes)."""
    todo, erased = list(nodes), set()
    while todo:
        n = todo.pop(0)
        if n in erased or n.users or n.op in ("placeholder", "get_attr", "output"):
            continue
        erased.add(n)
        inputs = n.all_input_nodes
        n.graph.erase_node(n)
        todo.extend(inputs)


def fuse_products(gm: fx.GraphModule, precision: str, report, found: list) -> None:
    """The products of two activations the chain finder saw (`found`: (node name, form)) in
    report.products as ProductSites: each that gemmfuse's batched product takes, and that on a
    GPU timed faster there, rewritten into a ``gemmfuse.products.matmul`` call carrying the
    choices of its three products. Never an error where PyTorch alone works."""
    from .products import ProductSite
    nodes = {n.name: n for n in gm.graph.nodes}
    report.products = [ProductSite(name, form) for name, form in found]
    for site in report.products:
        try:
            _fuse_product(nodes.get(site.node), site, precision)
        except Exception as e:  # noqa: BLE001
            site.reason = f"left after an error while choosing: {type(e).__name__}: {e}"[:300]
    if any(s.status == "fused" for s in report.products):
        gm.recompile()


def _fuse_product(node, site, precision: str) -> None:
    """One product: its reason, or the rewrite into the gemmfuse.products call that reads it
    (capture.product_calls), with the choices of its three products."""
    from . import products
    from .capture.product_calls import read_product
    call, why = read_product(node) if node is not None else (None, "the node is gone")
    if why:
        site.reason = why
        return
    infos = [node_info(t) for t in call.operands]
    training = _records_grad(node.graph.owning_module, call.operands)
    site.reason, ours = products.choice(*call.shapes, infos[0].device, training, precision)
    if site.reason:
        return
    node.op, node.target = "call_function", call.target
    node.args, node.kwargs = call.args, {"precision": precision, "ours": ours}
    site.status, site.call = "fused", call.target.__name__
    site.backward = ", ".join(f"{p} on {'gemmfuse' if o else 'PyTorch'}"
                              for p, o in zip(("dA", "dB"), ours[1:]))
