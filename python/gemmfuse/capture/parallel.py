"""Tensor parallelism at capture time: whether a chain found by optimize() can run fused on
its Linear's local shards (tensor_parallel.py says which parallel styles can)."""
from __future__ import annotations

from ..tensor_parallel import DTensor, is_dtensor, module_reason
from .find import _attr_tensor
from .values import AttrRef


def capture_reason(gm, chain) -> str:
    """At optimize time: '' unless the chain reads DTensors in a way that cannot run fused on
    local shards (module_reason), or reads DTensors without a Linear module to learn the
    style from (F.linear with a DTensor weight, DTensor operands)."""
    if DTensor is None:
        return ""
    attrs = [s for s in [chain.weight, chain.bias, *chain.operands, *chain.state]
             if isinstance(s, AttrRef) or (s is not None and s.op == "get_attr")]
    tensors = {a.qualname if isinstance(a, AttrRef) else a.target for a in attrs}
    dt = [q for q in tensors if is_dtensor(_attr_tensor(gm, q))]
    if not dt:
        return ""
    if chain.linear_module is None or any(not q.startswith(chain.linear_module + ".") for q in dt):
        return (f"DTensor {', '.join(sorted(dt))} outside a parallelized nn.Linear: the chain "
                f"runs in PyTorch")
    return module_reason(gm.get_submodule(chain.linear_module), chain.linear_module)
