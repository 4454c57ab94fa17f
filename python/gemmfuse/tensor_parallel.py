"""Tensor parallelism (``parallelize_module``'s ColwiseParallel / RowwiseParallel) and
gemmfuse chains.

``parallelize_module`` replaces a Linear's parameters by DTensors and registers two hooks on
it: the pre-hook makes the input a DTensor (``from_local`` with the style's input layout, then
the layout the product needs), the post-hook brings the output to the style's output layout
and, by default (``use_local_output=True``), back to a plain local tensor. Whatever follows
the Linear in the model (a chain's stages) then runs on that local tensor.

A column-parallel Linear (weight and bias ``Shard(0)``, input made ``Replicate``, output
``Shard(-1)``, returned local) computes, on each rank, ``x @ W_local.T + b_local``: its chain
runs fused on the local shards, every stage on the local columns as eager runs them after the
post-hook. The input goes through the same DTensor conversion as the hook's, and comes back
out with ``to_local(grad_placements=[Partial()])``: each rank's gradient for it is a partial
sum over its columns, and DTensor all-reduces it (reduce-scatters, for a sharded input
layout) in the backward, as the eager Linear's backward does. Weight and bias gradients
arrive as DTensors of their placements through ``to_local``'s backward.

A row-parallel Linear (weight ``Shard(1)``, bias ``Replicate``, input ``Shard(-1)``, output
``Replicate``, returned local) computes on each rank a partial sum ``x_local @ W_local.T`` that
an all-reduce completes before the bias and anything after it. Its chain is that product
alone (capture stops there: ``row_parallel_end``, and the spec has no bias); the product runs
fused on the local shards, and ``finish_row_parallel`` sums it over the ranks through DTensor
(``Partial`` -> ``Replicate``, whose backward hands each rank the whole gradient) and adds the
bias. The stages after it run in PyTorch on the summed output, as eager runs them.

Everything else runs in PyTorch, with the reason: a row-parallel Linear whose chain was
captured with stages (optimize() before parallelize_module), other output layouts (a
reduce-scatter), a column-parallel output kept as a DTensor or redistributed, other layouts,
and DTensors that no recognised style prepared. Under torch.compile, chains over DTensors are left
to Inductor (``dynamo_reason``); at optimize time ``capture.parallel.capture_reason`` reads
a chain's DTensors through ``module_reason``.
"""
from __future__ import annotations

from dataclasses import dataclass
from functools import partial
from typing import Any, Optional

import torch.nn as nn

try:
    from torch.distributed.tensor import DTensor, Partial, Replicate, Shard
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel
    from torch.distributed.device_mesh import DeviceMesh
except ImportError:  # a build without torch.distributed
    DTensor = None


def is_dtensor(t) -> bool:
    return DTensor is not None and isinstance(t, DTensor)


def local(t):
    """A DTensor's local shard (autograd-connected while grad mode is on), else t."""
    return t.to_local() if is_dtensor(t) else t


def settled(t):
    """t, its collective waited for where a style's hook returned it pending (an
    AsyncCollectiveTensor: an example value nothing else may read would never wait)."""
    wait = getattr(t, "wait", None) if type(t).__name__ == "AsyncCollectiveTensor" else None
    return wait() if wait is not None else t


def has_dtensor_params(module: nn.Module) -> bool:
    """Whether the module's own parameters are DTensors (distribute_module made them)."""
    return DTensor is not None and any(isinstance(p, DTensor) for p in module._parameters.values())


@dataclass
class Style:
    """What a ColwiseParallel/RowwiseParallel's hooks on a Linear do."""
    kind: str                  # "colwise" | "rowwise"
    mesh: Any
    input_layouts: tuple
    desired_input_layouts: tuple
    output_layouts: tuple
    use_local_output: bool


def _partial_in(hook):
    """(the functools.partial, the DeviceMesh) a distribute_module hook closes over."""
    cells = [c.cell_contents for c in (getattr(hook, "__closure__", None) or ())]
    fn = next((c for c in cells if hasattr(c, "func") and hasattr(c, "args")), None)
    mesh = next((c for c in cells if isinstance(c, DeviceMesh)), None)
    return fn, mesh


def style(module: nn.Module) -> Optional[Style]:
    """The parallel style whose two hooks (and only those) are on the module, else None."""
    d = module.__dict__
    pre, post = list(d["_forward_pre_hooks"].values()), list(d["_forward_hooks"].values())
    if (len(pre) != 1 or len(post) != 1 or d.get("_backward_hooks") or d.get("_backward_pre_hooks")
            or d.get("_forward_hooks_with_kwargs") or d.get("_forward_pre_hooks_with_kwargs")):
        return None
    (fin, mesh), (fout, mesh_out) = _partial_in(pre[0]), _partial_in(post[0])
    if fin is None or fout is None or mesh is None or mesh is not mesh_out:
        return None
    for kind, cls in (("colwise", ColwiseParallel), ("rowwise", RowwiseParallel)):
        if fin.func is cls._prepare_input_fn and fout.func is cls._prepare_output_fn:
            (inl, desired), (outl, use_local) = fin.args, fout.args
            return Style(kind, mesh, tuple(inl), tuple(desired), tuple(outl), bool(use_local))
    return None


def _is_last_dim_shard(placements: tuple) -> bool:
    return len(placements) == 1 and isinstance(placements[0], Shard) and placements[0].dim == -1


def module_reason(module: nn.Module, name: str) -> str:
    """'' where the Linear's chain runs fused on its local shard, else why PyTorch runs it."""
    st = style(module)
    w, b = module._parameters.get("weight"), module._parameters.get("bias")
    if st is None:
        return (f"'{name}' holds DTensor parameters but its hooks are not one ColwiseParallel or "
                f"RowwiseParallel: the chain runs in PyTorch")
    if st.kind == "rowwise":
        return _row_parallel_reason(st, w, b, name)
    if st.mesh.ndim != 1 or not is_dtensor(w) or w.device_mesh is not st.mesh:
        return f"'{name}' is column-parallel over a mesh gemmfuse does not run locally: PyTorch runs it"
    if tuple(w.placements) != (Shard(0),) or (b is not None and (
            not is_dtensor(b) or tuple(b.placements) != (Shard(0),))):
        return f"'{name}': weight or bias not sharded on dim 0 as ColwiseParallel shards them: PyTorch runs it"
    if st.desired_input_layouts != (Replicate(),) or not _is_last_dim_shard(st.output_layouts):
        return f"'{name}': a column-parallel layout other than Replicate -> Shard(-1): PyTorch runs it"
    if not st.use_local_output:
        return (f"'{name}' keeps its column-parallel output a DTensor (use_local_output=False): "
                f"the chain runs in PyTorch")
    return ""


def _row_parallel_reason(st: Style, w, b, name: str) -> str:
    """'' where a row-parallel Linear's product runs fused on its local shards."""
    if st.mesh.ndim != 1 or not is_dtensor(w) or w.device_mesh is not st.mesh:
        return f"'{name}' is row-parallel over a mesh gemmfuse does not run locally: PyTorch runs it"
    if tuple(w.placements) != (Shard(1),) or (b is not None and (
            not is_dtensor(b) or tuple(b.placements) != (Replicate(),))):
        return (f"'{name}' is row-parallel with its weight not sharded on dim 1 or its bias not "
                f"replicated, as RowwiseParallel leaves them: PyTorch runs it")
    if (not all(_is_last_dim_shard((p,)) for p in st.input_layouts + st.desired_input_layouts)
            or st.output_layouts != (Replicate(),) or not st.use_local_output):
        return (f"'{name}' is row-parallel with a layout other than Shard(-1) -> Replicate "
                f"(all-reduced, returned local): PyTorch runs it")
    return ""


def row_parallel_end(gm, chain) -> str:
    """At capture: why the chain ends at its Linear where that Linear is row-parallel (its
    product is a partial sum until the all-reduce), else ''. The chain is then the product
    alone, without the bias, which finish_row_parallel adds after the sum."""
    name = chain.linear_module
    if DTensor is None or not name:
        return ""
    try:
        st = style(gm.get_submodule(name))
    except AttributeError:  # not a submodule of this graph (a dynamo graph's naming)
        return ""
    if st is None or st.kind != "rowwise":
        return ""
    return (f"'{name}' is row-parallel: its product is all-reduced before the bias and what "
            f"follows, which run in PyTorch")


def _bare_product(rt) -> bool:
    """Whether every spec of the chain is a Linear without bias or stages (row_parallel_end's)."""
    return all("\n" not in s.strip() and s.split()[-1] == "bias=0" for s in rt.specs.values())


def finish_row_parallel(mesh, bias, y):
    """A row-parallel Linear's output from its local product y: summed over the ranks through
    DTensor (Partial -> Replicate, an all-reduce), then the bias (replicated) added."""
    y = DTensor.from_local(y, mesh, (Partial(),), run_check=False)
    y = y.redistribute(placements=(Replicate(),)).to_local()
    return y if bias is None else y + bias.to_local()


def local_inputs(rt, inputs: list):
    """At call time, for a chain whose inputs hold DTensors: (the inputs with x, W and b
    local, as the fused op reads them, or None; '' or why PyTorch runs the chain; None, or
    for a row-parallel Linear the function that makes its output from the fused product)."""
    i = getattr(rt, "linear_idx", None)
    if i is None:
        return None, "DTensor inputs without a parallelized nn.Linear: the chain runs in PyTorch", None
    name = rt.module_names[i]
    mod = inputs[i]
    why = module_reason(mod, name)
    if why:
        return None, why, None
    w, b = mod._parameters["weight"], mod._parameters.get("bias")
    if tuple(w._local_tensor.shape) != (rt.out_features, rt.in_features):
        return None, (f"'{name}' was parallelized after optimize() (local weight "
                      f"{list(w._local_tensor.shape)}, the chain was planned for "
                      f"[{rt.out_features}, {rt.in_features}]): optimize the model after "
                      f"parallelize_module to fuse it"), None
    st = style(mod)
    if st.kind == "rowwise" and not _bare_product(rt):
        return None, (f"'{name}' is row-parallel, and its chain was captured before "
                      f"parallelize_module with the bias or stages after the product: optimize "
                      f"the model after parallelize_module to fuse it"), None
    x = inputs[rt.x_idx]
    others = [inputs[j] for j in list(rt.op_idx) + list(rt.st_idx)]
    if is_dtensor(x) or any(is_dtensor(t) for t in others):
        return None, f"'{name}': the chain's input or operands are DTensors: PyTorch runs it", None
    # The pre-hook's conversion, then local: column-parallel with a partial-sum gradient
    # (all-reduced by DTensor), row-parallel with its shard's gradient
    xd = DTensor.from_local(x, st.mesh, st.input_layouts, run_check=False)
    if st.input_layouts != st.desired_input_layouts:
        xd = xd.redistribute(placements=st.desired_input_layouts)
    out = list(inputs)
    out[rt.w_idx] = w.to_local()
    if st.kind == "rowwise":
        out[rt.x_idx] = xd.to_local()
        return out, "", partial(finish_row_parallel, st.mesh, b)
    out[rt.x_idx] = xd.to_local(grad_placements=[Partial()])
    if rt.b_idx is not None:
        out[rt.b_idx] = b.to_local()
    return out, "", None


def dynamo_reason(x_node, weight_node) -> str:
    """The torch.compile backend: chains whose input or weight is a DTensor in dynamo's graph
    (parallelize_module's hooks inlined) are left to Inductor/PyTorch."""
    for n in (x_node, weight_node):
        meta = getattr(n, "meta", {})
        v = meta.get("example_value", meta.get("val"))
        if is_dtensor(v):
            return "a DTensor input (tensor parallel under torch.compile): left to PyTorch's own lowering"
    return ""
