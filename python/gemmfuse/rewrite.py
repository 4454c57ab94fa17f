"""Rewriting a graph: a captured chain's nodes become one ``_run_chain`` call whose
``ChainRuntime`` holds the chain's specs, its inputs' positions and a fallback graph of the
original nodes."""
from __future__ import annotations

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


def _resolve(remap: dict, n):
    while isinstance(n, fx.Node) and n in remap:
        n = remap[n]
    return n


@dataclass
class Rewritten:
    node: fx.Node
    runtime: ChainRuntime
    sources: list


def rewrite_chain(gm: fx.GraphModule, chain: Chain, precision: str, remap: dict,
                  attr_name: str) -> Rewritten:
    """Replace the chain's nodes by ``_run_chain(gm.<attr_name>, [inputs...])``."""
    g = gm.graph
    chain_nodes = chain.nodes
    chain_set = set(chain_nodes)
    sources, index = [], {}

    def add(src):
        src = _resolve(remap, src)
        k = source_key(src)
        if k not in index:
            index[k] = len(sources)
            sources.append(src)
        return index[k]

    module_idx = []  # the modules the chain replaces: their hooks send calls to the fallback
    for n in chain_nodes:
        for a in _flatten_nodes((n.args, n.kwargs)):
            if a not in chain_set:
                add(a)
        if n.op == "call_module":
            module_idx.append((add(AttrRef(n.target)), n.target))
    x_idx = add(chain.x)
    w_idx = add(chain.weight)
    b_idx = add(chain.bias) if chain.bias is not None else None
    op_idx = [add(s) for s in chain.operands]
    st_idx = [add(s) for s in chain.state]
    mode_idx = [add(AttrRef(q)) for q in chain.mode_modules]
    guards = [(add(n), v, _number_name(n)) for n, v in chain.guards.items()]

    # The fallback: the original nodes as a graph of their own, every input an argument.
    fb = fx.Graph()
    ph = [fb.placeholder(f"in{i}") for i in range(len(sources))]
    env = {}

    def tr(a):
        if a in env:
            return env[a]
        return ph[index[source_key(_resolve(remap, a))]]

    for n in chain_nodes:
        if n.op == "call_module":
            mod_in = ph[index[source_key(AttrRef(n.target))]]
            args = fx.node.map_arg(n.args, tr)
            kwargs = fx.node.map_arg(n.kwargs, tr)
            env[n] = fb.call_function(_call_module, (mod_in,) + tuple(args), dict(kwargs))
        else:
            env[n] = fb.node_copy(n, tr)
    fb.output(env[chain.output])
    fallback = fx.GraphModule(nn.Module(), fb, class_name="GemmfuseFallback")

    specs = {flags: chain.spec(flags) for flags in chain.flag_combos()}
    xinf = node_info(chain.x)
    rt = ChainRuntime(chain.index, specs, x_idx, w_idx, b_idx, op_idx, st_idx, mode_idx,
                      list(chain.mode_modules), precision, fallback, chain.in_features,
                      xinf.rank if isinstance(xinf, TInfo) else None, guards,
                      dict(module_idx), chain.weight_kn)
    rt.example_sources = [example_record(src) for src in sources]
    setattr(gm, attr_name, rt)

    last = chain.output
    with g.inserting_before(last):
        getattrs = {}
        args = []
        for src in sources:
            if isinstance(src, AttrRef):
                if src.qualname not in getattrs:
                    getattrs[src.qualname] = g.get_attr(src.qualname)
                args.append(getattrs[src.qualname])
            else:
                args.append(src)
        rt_node = g.create_node("get_attr", attr_name)  # a plain attribute: skip get_attr's check
        new = g.call_function(_run_chain, (rt_node, args))
    new.meta.update({k: v for k, v in last.meta.items()
                     if k in ("gemmfuse_info", "example_value", "val", "tensor_meta", "stack_trace")})
    last.replace_all_uses_with(new)
    remap[last] = new
    for n in reversed(chain_nodes):
        g.erase_node(n)
    return Rewritten(new, rt, sources)


def _number_name(node: fx.Node) -> str:
    """What a guarded number is called in messages: the graph input it is read from."""
    if node.op == "call_method" and node.target == "item" and isinstance(node.args[0], fx.Node):
        node = node.args[0]
    return node.name


def example_tensor(gm: fx.GraphModule, src) -> Any:
    """A tensor standing in for a source at describe time: real attributes, zeros otherwise."""
    if isinstance(src, AttrRef):
        return _attr_tensor(gm, src.qualname)
    if src.op == "get_attr":
        return _attr_tensor(gm, src.target)
    inf = node_info(src)
    if isinstance(inf, TInfo):
        return torch.zeros(inf.shape, dtype=inf.dtype, device=inf.device)
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
