"""``gemmfuse.explain(module[, example_inputs])``: what was fused, how, and what was not, and why.

For an optimized module: every chain with the PyTorch nodes it replaced, its spec (at the
module's current training flags), the C++ plan (``describe``: rewrites and steps), why the
chain ends where it does, every fallback to PyTorch with its reason and count, and the input
shapes the chain ran fused with, with the plan at each (kernels are chosen by shape). For a
module compiled with ``torch.compile(module, backend="gemmfuse")`` and called, the same for
each graph the backend rewrote for it. For a plain module, it is optimized first with
``example_inputs``.
"""
from __future__ import annotations


import torch

from . import _lib, direct
from .runtime import DATA_WRITES
from .reports import compiled_graphs
from .dynamo_module import GemmfuseDynamoModule
from .optimized import optimize
from .rewrite import example_from_record


def _current_plan(module, entry, rt):
    """describe() at the module's current training flags and the optimize-time shapes."""
    flags = tuple(bool(module.get_submodule(q).training) for q in rt.mode_names)
    spec = rt.specs[flags]
    if spec == entry.spec:
        return spec, entry.plan
    try:
        plan = "(plan at the current training flags)\n" + _describe_with_example(module, rt, spec)
    except (RuntimeError, ValueError, TypeError, AttributeError) as e:
        plan = f"(no plan at the current training flags: {_lib.unsupported_reason(e)})"
    return spec, plan


def _describe_with_example(module, rt, spec, x=None):
    """The plan for spec at the optimize-time shapes, or for input `x` when given."""
    ts = [None if x is not None and i == rt.x_idx else example_from_record(module, r)
          for i, r in enumerate(rt.example_sources)]
    x = ts[rt.x_idx] if x is None else x
    ops = [ts[i].to(x.dtype) for i in rt.op_idx]
    w = ts[rt.w_idx].t().contiguous() if rt.weight_kn else ts[rt.w_idx]
    return _lib.describe(spec, x, w, None if rt.b_idx is None else ts[rt.b_idx], ops,
                         [ts[i] for i in rt.st_idx], rt.precision)


def _plans_by_input(module, rt, shown_spec) -> list:
    """One line (and the plan, where it differs from the one printed above) per input
    signature the chain ran fused with: the planner picks kernels by shape, and explain's
    main plan is at the optimize-time shape (shown_spec: the spec of the plan printed above,
    None when none was: torch.compile's chains are planned at their first call)."""
    if not rt.seen:
        return []
    kind, info = rt.example_sources[rt.x_idx]
    example = (tuple(info.shape), info.dtype, info.device) if kind == "info" and info else None
    lines = ["  fused calls by input (latest last):"]
    for shape, dtype, device, flags, train in rt.seen:
        head = f"    x {list(shape)} {dtype} on {device}" + (" while autograd recorded" if train else "")
        if rt.mode_names:
            head += " (training: " + ", ".join(
                f"{q}={f}" for q, f in zip(rt.mode_names, flags)) + ")"
        timed = rt.timed.get((shape, dtype, device, flags, train))
        if timed is not None:
            own = f" on fp32's kernel, fast's own {timed[2]:.4g} ms" if timed[2] is not None else ""
            what = "forward and backward " if train else ""
            head += f" ({what}timed once: fused {timed[0]:.4g} ms{own}, PyTorch {timed[1]:.4g} ms)"
        spec = rt.specs[flags]
        if (shape, dtype, device) == example and spec == shown_spec:
            lines.append(head + ": the plan above")
            continue
        # A stand-in with x's metadata and one element of storage: the planner reads only
        # shapes, dtype and device.
        x = torch.empty((), dtype=dtype, device=device).expand(shape)
        try:
            plan = _describe_with_example(module, rt, spec, x=x)
        except (RuntimeError, ValueError, TypeError, AttributeError) as e:
            plan = f"(no plan: {_lib.unsupported_reason(e)})"
        lines.append(head + ", plan:")
        # No blank lines inside one entry of the list (the CUDA plan has one before its
        # kernels): each entry reads as one indented block.
        lines.append(_indent("\n".join(line for line in plan.splitlines() if line.strip()), " " * 6))
    return lines


def _indent(text: str, pad: str = "    ") -> str:
    return "\n".join(pad + line if line else line for line in text.rstrip("\n").splitlines())


def explain_text(module) -> str:
    rep = getattr(module, "_gemmfuse", None)
    if rep is None:
        raise ValueError("gemmfuse.explain: this module is not optimized; call "
                         "gemmfuse.explain(model, example_inputs) to optimize it first")
    out = _head_lines(module, rep)
    for e in rep.entries:
        out.extend(_entry_lines(module, rep, e))
    if rep.rejected:
        out.append("")
        out.append("not captured:")
        for name, reason in rep.rejected:
            out.append(f"  {name}: {reason}")
    out.extend(_product_lines(rep))
    out.extend(_lm_head_lines(rep))
    out.extend(_attention_lines(rep))
    if not (rep.entries or rep.rejected or rep.units or rep.lm_heads or rep.attention):
        out.append("  (no Linear found)")
    out.extend(_fsdp_lines(module, rep))
    return "\n".join(out) + "\n"


def _product_lines(rep) -> list:
    """The matrix products no chain starts at (no weight operand: two activations): on
    gemmfuse's batched GEMM (and where the backward's products run), or why not."""
    if not rep.products:
        return []
    where = "Inductor" if rep.flavor == "inductor" else "PyTorch"
    out = ["", "matrix products of two activations (no weight operand, so no chain starts there):"]
    for p in rep.products:
        if p.status == "fused":
            out.append(f"  {p.node}: {p.form} on gemmfuse's GEMM (gemmfuse.products.{p.call}; "
                       f"backward: {p.backward})")
        else:
            out.append(f"  {p.node}: {p.form} left to {where}: {p.reason}")
    return out


def _lm_head_lines(rep) -> list:
    """The LM heads (a Linear whose logits only feed a cross-entropy loss): fused into one
    linear_cross_entropy call, with its chunks and where its products run, or why not."""
    out, left = [], "left to Inductor" if rep.flavor == "inductor" else "left to PyTorch"
    for h in rep.lm_heads:
        where = f"{h.linear} [{h.in_features} → {h.out_features}] ({h.form}, {h.loss})"
        if h.status != "fused":
            out += ["", f"LM head + cross-entropy: {where} {left}: {h.reason}"]
            continue
        plan = h.plan.splitlines() or [""]
        out += ["", f"LM head + cross-entropy: {where} fused (gemmfuse.linear_cross_entropy, "
                    f"without the [M, V] logits; {plan[0]})"]
        out.extend("  " + line for line in plan[1:])
    return out


def _attention_lines(rep) -> list:
    """The attention calls: on gemmfuse's split-product attention kernels, or why not."""
    out, left = [], "left to Inductor" if rep.flavor == "inductor" else "left to PyTorch"
    for a in rep.attention:
        shape = "x".join(str(d) for d in a.shape) if a.shape else "?"
        mask = f" masked by a {str(a.mask[1]).replace('torch.', '')} mask {list(a.mask[0])}" if a.mask else ""
        gqa = f" with {a.kv_heads} key/value heads" if a.kv_heads else ""
        keys = f" over {a.kv_len} keys" if a.kv_len else ""
        where = f"{a.node} [{shape}]{keys}{' causal' if a.is_causal else ''}{mask}{gqa} ({a.form})"
        if a.status == "fused":
            out += ["", f"attention: {where} on gemmfuse's fp32 attention kernels "
                        "(gemmfuse.attention.scaled_dot_product_attention: split fp16 products, "
                        "forward and backward)"]
        else:
            out += ["", f"attention: {where} {left}: {a.reason}"]
    return out


def _head_lines(module, rep) -> list:
    """How many chains are fused, the whole module's timing, retraces, the call path."""
    fused = [e for e in rep.entries if e.status == "fused"]
    out = [f"gemmfuse: {len(fused)} of {len(rep.entries)} chain(s) fused "
           f"(precision {rep.precision}, {rep.flavor} capture)"
           + (f"; it calls {len(rep.units)} FSDP unit(s), each explained below" if rep.units else "")]
    whole = rep.whole or module.__dict__.get("_gemmfuse_whole")
    if whole:
        out.append(whole)
    if rep.retraced:
        out.append(f"traced again {len(rep.retraced)} time(s), because these changed since the "
                   f"previous trace: " + ", ".join(rep.retraced))
    if fused:
        out.append("weights: prepared data follows version counters; " + DATA_WRITES)
    if direct.active(module):
        out.append("call path: direct (the whole forward is one fused chain; hooks, keyword "
                   "arguments, tracing and compiling take the normal module call)")
    return out


def _entry_lines(module, rep, e) -> list:
    """One chain: where it runs and why, the nodes it replaces, its spec and plan, its calls."""
    rt = getattr(module, e.attr) if e.attr else None
    elsewhere = "left to Inductor" if rep.flavor == "inductor" else "left in PyTorch"
    out = ["", f"chain {e.index} (from {e.linear}, {e.form}): "
           + ("FUSED" if e.status == "fused" else f"{elsewhere}: {e.reason}")]
    if e.choice and e.status == "fused":
        out.append(f"  measured choice: {e.choice}")
    out.append("  replaces these PyTorch nodes:")
    out.extend("    " + n for n in e.nodes)
    out.append(f"  chain ends because: {e.stop or 'end of graph'}")
    if rt is not None and rt.guards:
        out.append("  numbers read at compile time, held by the spec (a call that brings "
                   "another value runs in PyTorch): "
                   + ", ".join(f"{name} = {v!r}" for _, v, name in rt.guards))
    spec, plan = e.spec, e.plan
    if rt is not None and rt.mode_names:
        spec, plan = _current_plan(module, e, rt)
        out.append("  mode-dependent stages follow: " + ", ".join(rt.mode_names))
    out.append("  spec:")
    out.append(_indent(spec.replace("; ", "\n")))
    if plan:
        out.append("  plan:")
        out.append(_indent(plan))
    if rep.flavor == "inductor" and e.status == "fused":
        fwd, train = torch.ops.gemmfuse.calls(e.spec)
        out.append(f"  runtime: {fwd + train} fused call(s) of this spec issued in this "
                   f"process, {train} of them while autograd recorded (CUDA graph replays "
                   f"are not counted)")
    if rt is not None:
        out.extend(_runtime_lines(module, rt, spec if plan else None))
    return out


def _runtime_lines(module, rt, shown_spec) -> list:
    """A chain runtime's counts, its plans by input signature, and its fallbacks."""
    out = [f"  runtime: {rt.fused_calls} fused call(s), {rt.train_calls} of them "
           f"while autograd recorded"]
    out.extend(_plans_by_input(module, rt, shown_spec))
    if not rt.fallbacks:
        return out + ["  fallbacks to PyTorch: none"]
    out.append("  fallbacks to PyTorch:")
    out.extend(f"    {count}x {reason}" for reason, count in rt.fallbacks.items())
    return out


def _fsdp_lines(module, rep) -> list:
    """FSDP2: how the module runs inside fully_shard's hooks, and each unit its graph calls
    (fsdp.py), with the unit's own explanation indented."""
    out = []
    hooks = module.__dict__.get("_gemmfuse_fsdp")
    if hooks is not None:
        out += ["", f"FSDP2: this graph runs between the pre- and post-forward hooks of "
                    f"fully_shard's unit {hooks.qualname!r} (the fused ops read the parameters "
                    f"it has unsharded; their gradients go back to it for the reduce-scatter)"]
        out += [f"  {n}x ran in PyTorch: {why}" for why, n in hooks.fallbacks.items()]
    for u in rep.units:
        out.append("")
        if u.opt is None:
            out.append(f"FSDP unit '{u.qualname}': runs in PyTorch: {u.reason or 'not called yet'}")
            continue
        out.append(f"FSDP unit '{u.qualname}': its own forward, optimized:")
        out.append(_indent(explain_text(u.opt)))
    return out


def compiled_text(graphs) -> str:
    """explain_text of each graph the torch.compile backend rewrote for one module."""
    head = (f"torch.compile: {len(graphs)} graph(s) compiled by the gemmfuse backend for this "
            f"module (oldest first; dynamo compiles again for new guards, e.g. a new input "
            f"shape or training flag)")
    parts = [head]
    for i, gm in enumerate(graphs):
        parts.append(f"\n=== graph {i + 1} of {len(graphs)} ===")
        parts.append(explain_text(gm).rstrip("\n"))
    return "\n".join(parts) + "\n"


def explain(module, example_inputs=None, precision: str = "fp32", print_it: bool = True) -> str:
    """Explain an optimized module (or optimize ``module`` with ``example_inputs`` first), or
    a module compiled with ``torch.compile(module, backend="gemmfuse")`` that has been called
    (its graphs). Returns the text; prints it too (with rich, when installed) unless
    ``print_it=False``."""
    optimized = getattr(module, "_gemmfuse", None) is not None
    through_dynamo = isinstance(module, GemmfuseDynamoModule)
    compiled = hasattr(module, "_orig_mod") or through_dynamo  # torch.compile's wrapper
    if (optimized or compiled) and example_inputs is not None:
        raise ValueError(f"gemmfuse.explain: the module is already "
                         f"{'optimized' if optimized else 'compiled'}, so example_inputs would "
                         f"go unused; call it on your inputs, and explain lists the plan at "
                         f"each input shape it ran with")
    if optimized:
        text = explain_text(module)
    else:
        graphs = compiled_graphs(module) if example_inputs is None else []
        if graphs:
            text = compiled_text(graphs)
            if through_dynamo:
                whole = module.__dict__.get("_gemmfuse_whole")
                text = (f"optimize: {type(module.__dict__['_gemmfuse_source']).__name__} was "
                        f"captured through torch.compile with the gemmfuse backend, the rest of "
                        f"its graph run as PyTorch ops (not torch.fx: "
                        f"{module.__dict__['_gemmfuse_why_not_fx']})\n"
                        + (whole + "\n" if whole else "") + text)
        elif example_inputs is None:
            raise ValueError(
                "gemmfuse.explain: no gemmfuse compilation of this module found (a module "
                "compiled with torch.compile(module, backend='gemmfuse') is explained once it "
                "has been called); a plain module needs example_inputs to optimize it")
        else:
            text = explain_text(optimize(module, example_inputs, precision=precision))
    if print_it:
        try:
            from rich.console import Console
            from rich.markup import escape
            con = Console()
            for line in text.splitlines():
                style = None
                if line.startswith("chain "):
                    style = "bold green" if "FUSED" in line else "bold yellow"
                elif line.startswith("gemmfuse:"):
                    style = "bold"
                elif line.startswith("not captured"):
                    style = "bold red"
                con.print(escape(line), style=style, highlight=False, soft_wrap=True)
        except ImportError:
            print(text)
    return text
