"""A two-operand einsum as one batched product: the labels both operands and the output hold
are batch dims, those of one operand and the output are its rows (a) or columns (b), those of
both operands but not the output are contracted. ``a`` is permuted to [batch, rows, k] and
``b`` to [batch, k, cols], one [B, M, K] @ [B, K, N] product runs, and its output is reshaped
and permuted to the equation's output (what torch.einsum itself does around its bmm).

Equations this plan does not take (None, with the reason from ``why_not``): an ellipsis, an
implicit output, a label repeated within an operand (a diagonal), a label summed over one
operand only, batch dims of different sizes (broadcasting)."""
from __future__ import annotations

import math
from dataclasses import dataclass
from functools import lru_cache
from typing import Optional


@dataclass(frozen=True)
class EinsumPlan:
    a_perm: tuple      # a's dims in the order batch, rows, k
    b_perm: tuple      # b's dims in the order batch, k, cols
    n_batch: int
    n_rows: int        # a's row labels (after the batch ones)
    n_k: int
    out_perm: tuple    # the product's [batch, rows, cols] dims in the output's order

    def operands(self, a, b):
        """a as [B, M, K] and b as [B, K, N] (views where the permutes allow)."""
        ap, bp = a.permute(self.a_perm), b.permute(self.b_perm)
        nb, nr, nk = self.n_batch, self.n_rows, self.n_k
        B = math.prod(ap.shape[:nb])
        M, K = math.prod(ap.shape[nb:nb + nr]), math.prod(ap.shape[nb + nr:])
        return ap.reshape(B, M, K), bp.reshape(B, K, math.prod(bp.shape[nb + nk:])), ap, bp

    def output(self, c, ap, bp):
        """The product c [B, M, N] in the equation's output shape and order."""
        nb, nr, nk = self.n_batch, self.n_rows, self.n_k
        dims = (*ap.shape[:nb + nr], *bp.shape[nb + nk:])
        return c.reshape(dims).permute(self.out_perm)


def why_not(equation: str, a_shape, b_shape) -> str:
    """'' where ``plan`` takes the einsum of these shapes, else the reason."""
    try:
        p = _plan(equation.replace(" ", ""), len(a_shape), len(b_shape))
    except ValueError as e:
        return str(e)
    ap = [a_shape[i] for i in p.a_perm]
    bp = [b_shape[i] for i in p.b_perm]
    nb, nk = p.n_batch, p.n_k
    if ap[:nb] != bp[:nb] or ap[len(ap) - nk:] != bp[nb:nb + nk]:
        return "dims of one label with different sizes (einsum broadcasts them)"
    return ""


def plan(equation: str, a_dims: int, b_dims: int) -> Optional[EinsumPlan]:
    try:
        return _plan(equation.replace(" ", ""), a_dims, b_dims)
    except ValueError:
        return None


@lru_cache(maxsize=256)
def _plan(equation: str, a_dims: int, b_dims: int) -> EinsumPlan:
    a, b, out = _terms(equation, a_dims, b_dims)
    batch = [c for c in out if c in a and c in b]
    rows = [c for c in out if c in a and c not in b]
    cols = [c for c in out if c in b and c not in a]
    k = [c for c in a if c in b and c not in out]
    order = batch + rows + cols
    return EinsumPlan(a_perm=tuple(a.index(c) for c in batch + rows + k),
                      b_perm=tuple(b.index(c) for c in batch + k + cols),
                      n_batch=len(batch), n_rows=len(rows), n_k=len(k),
                      out_perm=tuple(order.index(c) for c in out))


def _terms(equation: str, a_dims: int, b_dims: int) -> tuple:
    """The equation's terms (a, b, out); ValueError with the reason where the plan declines."""
    if "..." in equation or "->" not in equation:
        raise ValueError("an einsum with an ellipsis or an implicit output")
    ins, out = equation.split("->")
    terms = ins.split(",")
    if len(terms) != 2:
        raise ValueError("an einsum of other than two operands")
    a, b = terms
    if len(a) != a_dims or len(b) != b_dims:
        raise ValueError("an equation whose terms do not match the operands' dims")
    if any(len(set(t)) != len(t) for t in (a, b, out)):
        raise ValueError("a label repeated within a term (a diagonal)")
    if set(out) - set(a) - set(b) or (set(a) ^ set(b)) - set(out):
        raise ValueError("a label summed over one operand only, or an unknown output label")
    return a, b, out
