"""The model zoo of ``python -m bench --zoo``: fourteen real architectures, written here in plain
PyTorch the way people write them (no gemmfuse imports), each at three batch kinds:

  tiny   a few rows at reduced widths: every model runs on a 2-core CPU in well under a
         second (the CPU tests)
  small  the real widths at a launch-bound batch (one image, a short sequence, a few rows)
  large  the real widths at a compute-bound batch that fills an H100, sized to stay under
         ~10 GB in fp32 training with AdamW and ~50 ms per eager fp32 training step (from
         the FLOPs at fp32's ~50 TFLOP/s), so that the whole zoo stays within device-time
         limits

``ZOO`` maps a name to a :class:`ZooModel`; ``entry.build(kind, device, dtype)`` returns
``(model, make_inputs, loss_fn)``: ``make_inputs(seed)`` gives a tuple of the forward's
arguments (fresh random data from a CPU generator, so the same on every device; integer
tensors stay integer), ``loss_fn(output, inputs)`` a scalar (floating losses in float32 or
float64, targets fixed at build time). Models with state between calls have ``reset()``: call
it after ``.to(dtype)`` and before a sequence of calls (the bench does, for every copy).
"""
from __future__ import annotations

import functools
from dataclasses import dataclass, field
from typing import Callable

import torch
import torch.nn as nn
import torch.nn.functional as F

KINDS = ("tiny", "small", "large")


@dataclass(frozen=True)
class ZooModel:
    """One architecture: ``build(kind, device="cpu", dtype=torch.float32)`` ->
    ``(model, make_inputs(seed) -> tuple, loss_fn(output, inputs) -> scalar)``; ``batches``:
    each kind's configuration (what build uses); ``note``: what the model is and where it
    departs from the original."""
    name: str
    build: Callable
    batches: dict = field(default_factory=dict)
    note: str = ""
    # The large kind's estimated eager fp32 training step on an H100 stays under this (count's
    # estimate): the zoo's models fill a GPU within ~50 ms; a whole model may take longer.
    budget_ms: float = 50.0


# ------------------------------------------------------------------------------ plumbing
def _upcast(t):
    """Losses of 16-bit outputs in float32 (float64 stays float64)."""
    return t if t.dtype == torch.float64 else t.float()


def _mse(out, target):
    o = _upcast(out)
    return F.mse_loss(o, target.to(o.dtype))


def _build(make, batches, kind, device="cpu", dtype=torch.float32):
    """Build `make`'s model at `batches[kind]` with its parameters created on `device` (meta
    too), in `dtype`. `make(c)` returns (model, inputs(gen) -> tuple of CPU tensors,
    target(gen) -> CPU tensor or None, loss(out, target))."""
    if kind not in batches:
        raise KeyError(f"batch kind {kind!r}; known: {', '.join(batches)}")
    dev = torch.device(device)
    with dev:
        model, inputs, target, loss = make(batches[kind])
    model = model.to(dtype)
    if hasattr(model, "reset"):
        model.reset()  # its state in the new dtype

    def cast(t):
        return t.to(dev, dtype) if t.is_floating_point() else t.to(dev)

    def make_inputs(seed):
        return tuple(cast(t) for t in inputs(torch.Generator().manual_seed(int(seed))))

    t = target(torch.Generator().manual_seed(10_007)) if target is not None else None
    t = t.to(dev) if t is not None else None  # floating targets in float32: the loss upcasts

    def loss_fn(output, _inputs):
        return loss(output, t)
    return model, make_inputs, loss_fn


def _entry(name, make, batches, note, budget_ms=50.0):
    return ZooModel(name, functools.partial(_build, make, batches), batches, note, budget_ms)


def _randn(g, *shape, scale=1.0):
    return torch.randn(*shape, generator=g) * scale


def _uniform(g, *shape, lo=-1.0, hi=1.0):
    return torch.rand(*shape, generator=g) * (hi - lo) + lo


def _labels(classes, *shape):
    return lambda g: torch.randint(0, classes, shape, generator=g)


def _ce(out, target):
    return F.cross_entropy(_upcast(out), target)


# ------------------------------------------------------------------------- the architectures
class ViT(nn.Module):
    """ViT-S/16: Conv2d patch embedding, class token, learned positions, a pre-LN
    ``nn.TransformerEncoder`` (GELU MLP, no dropout), final LayerNorm, linear head on the class
    token."""

    def __init__(self, img=224, patch=16, dim=384, heads=6, depth=12, mlp=1536, classes=1000):
        super().__init__()
        self.patch_embed = nn.Conv2d(3, dim, patch, stride=patch)
        self.cls_token = nn.Parameter(torch.randn(1, 1, dim) * 0.02)
        self.pos_embed = nn.Parameter(torch.randn(1, (img // patch) ** 2 + 1, dim) * 0.02)
        layer = nn.TransformerEncoderLayer(dim, heads, mlp, dropout=0.0, activation="gelu",
                                           batch_first=True, norm_first=True)
        self.encoder = nn.TransformerEncoder(layer, depth, enable_nested_tensor=False)
        self.norm = nn.LayerNorm(dim)
        self.head = nn.Linear(dim, classes)

    def forward(self, images):
        x = self.patch_embed(images).flatten(2).transpose(1, 2)
        x = torch.cat((self.cls_token.expand(x.shape[0], -1, -1), x), dim=1) + self.pos_embed
        x = self.norm(self.encoder(x))
        return self.head(x[:, 0])


def _vit(c):
    model = ViT(c["img"], c["patch"], c["dim"], c["heads"], c["depth"], c["mlp"], c["classes"])
    b, img = c["batch"], c["img"]
    return model, lambda g: (_randn(g, b, 3, img, img),), _labels(c["classes"], b), _ce


class GPT2Block(nn.Module):
    """One GPT-2 block (nanoGPT's): pre-LN, fused QKV projection, causal SDPA, output
    projection; MLP 4x with GELU(tanh); residuals around both."""

    def __init__(self, dim=768, heads=12):
        super().__init__()
        self.heads = heads
        self.ln_1 = nn.LayerNorm(dim)
        self.c_attn = nn.Linear(dim, 3 * dim)
        self.c_proj = nn.Linear(dim, dim)
        self.ln_2 = nn.LayerNorm(dim)
        self.c_fc = nn.Linear(dim, 4 * dim)
        self.mlp_proj = nn.Linear(4 * dim, dim)

    def forward(self, x):
        B, T, C = x.size()
        q, k, v = self.c_attn(self.ln_1(x)).split(C, dim=2)
        q = q.view(B, T, self.heads, C // self.heads).transpose(1, 2)
        k = k.view(B, T, self.heads, C // self.heads).transpose(1, 2)
        v = v.view(B, T, self.heads, C // self.heads).transpose(1, 2)
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.c_proj(y.transpose(1, 2).contiguous().view(B, T, C))
        return x + self.mlp_proj(F.gelu(self.c_fc(self.ln_2(x)), approximate="tanh"))


def _block(c, model):
    """A transformer block on [batch, seq, dim] inputs, with an MSE loss against random targets."""
    b, t, d = c["batch"], c["seq"], c["dim"]
    return model, lambda g: (_randn(g, b, t, d),), lambda g: _randn(g, b, t, d), _mse


def _gpt2(c):
    return _block(c, GPT2Block(c["dim"], c["heads"]))


def _mingpt_block(c):
    """minGPT's block (bench/models.py: attention written out as QK^T, scale, masked_fill,
    softmax, @V), the block of issue 48's target."""
    from .models import GPTBlock
    return _block(c, GPTBlock(c["dim"], c["heads"], block_size=c["seq"]))


class GPT2(nn.Module):
    """GPT-2 (nanoGPT's): token and learned position embeddings, pre-LN GPT2Blocks, a final
    LayerNorm and the LM head tied to the token embedding (no bias); the forward returns the
    cross-entropy of the next-token targets. Weights drawn as GPT-2's: N(0, 0.02), biases 0."""

    def __init__(self, vocab, ctx, dim, heads, layers):
        super().__init__()
        self.wte, self.wpe = nn.Embedding(vocab, dim), nn.Embedding(ctx, dim)
        self.h = nn.ModuleList(GPT2Block(dim, heads) for _ in range(layers))
        self.ln_f = nn.LayerNorm(dim)
        self.lm_head = nn.Linear(dim, vocab, bias=False)
        self.lm_head.weight = self.wte.weight
        for m in self.modules():
            if isinstance(m, (nn.Linear, nn.Embedding)):
                nn.init.normal_(m.weight, std=0.02)
            if isinstance(m, nn.Linear) and m.bias is not None:
                nn.init.zeros_(m.bias)

    def forward(self, idx, targets):
        x = self.wte(idx) + self.wpe(torch.arange(idx.size(1), device=idx.device))
        for block in self.h:
            x = block(x)
        logits = self.lm_head(self.ln_f(x))
        return F.cross_entropy(logits.view(-1, logits.size(-1)), targets.view(-1))


def _gpt2_small(c):
    b, t, v = c["batch"], c["seq"], c["vocab"]

    def inputs(g):
        return (torch.randint(0, v, (b, t), generator=g), torch.randint(0, v, (b, t), generator=g))
    return (GPT2(v, c["ctx"], c["dim"], c["heads"], c["layers"]), inputs, None,
            lambda out, _t: out)


class BertLayer(nn.Module):
    """One BERT-base encoder layer (Hugging Face's layout): separate Q, K, V projections,
    SDPA without a mask, output projection, post-LN residuals (eps 1e-12), FFN with GELU."""

    def __init__(self, dim=768, heads=12, ffn=3072):
        super().__init__()
        self.heads = heads
        self.query, self.key, self.value = (nn.Linear(dim, dim) for _ in range(3))
        self.attn_out = nn.Linear(dim, dim)
        self.attn_norm = nn.LayerNorm(dim, eps=1e-12)
        self.intermediate = nn.Linear(dim, ffn)
        self.output = nn.Linear(ffn, dim)
        self.out_norm = nn.LayerNorm(dim, eps=1e-12)

    def forward(self, x):
        B, T, C = x.shape

        def split(t):
            return t.view(B, T, self.heads, C // self.heads).transpose(1, 2)
        ctx = F.scaled_dot_product_attention(split(self.query(x)), split(self.key(x)),
                                             split(self.value(x)))
        x = self.attn_norm(x + self.attn_out(ctx.transpose(1, 2).reshape(B, T, C)))
        return self.out_norm(x + self.output(F.gelu(self.intermediate(x))))


def _bert(c):
    b, t, d = c["batch"], c["seq"], c["dim"]
    return (BertLayer(d, c["heads"], c["ffn"]), lambda g: (_randn(g, b, t, d),),
            lambda g: _randn(g, b, t, d), _mse)


class MixerBlock(nn.Module):
    """Token mixing (an MLP across the patches, per channel), then channel mixing (an MLP
    across the channels, per patch); pre-LN, GELU, residuals."""

    def __init__(self, tokens, dim, token_mlp, channel_mlp):
        super().__init__()
        self.norm1 = nn.LayerNorm(dim)
        self.token_fc1, self.token_fc2 = nn.Linear(tokens, token_mlp), nn.Linear(token_mlp, tokens)
        self.norm2 = nn.LayerNorm(dim)
        self.channel_fc1 = nn.Linear(dim, channel_mlp)
        self.channel_fc2 = nn.Linear(channel_mlp, dim)

    def forward(self, x):
        y = self.norm1(x).transpose(1, 2)
        x = x + self.token_fc2(F.gelu(self.token_fc1(y))).transpose(1, 2)
        return x + self.channel_fc2(F.gelu(self.channel_fc1(self.norm2(x))))


class Mixer(nn.Module):
    """MLP-Mixer: Conv2d patch embedding, Mixer blocks, LayerNorm, mean over patches, head."""

    def __init__(self, img, patch, dim, token_mlp, channel_mlp, depth, classes):
        super().__init__()
        tokens = (img // patch) ** 2
        self.stem = nn.Conv2d(3, dim, patch, stride=patch)
        self.blocks = nn.Sequential(*(MixerBlock(tokens, dim, token_mlp, channel_mlp)
                                      for _ in range(depth)))
        self.norm = nn.LayerNorm(dim)
        self.head = nn.Linear(dim, classes)

    def forward(self, images):
        x = self.blocks(self.stem(images).flatten(2).transpose(1, 2))
        return self.head(self.norm(x).mean(dim=1))


def _mixer(c):
    model = Mixer(c["img"], c["patch"], c["dim"], c["token_mlp"], c["channel_mlp"], c["depth"],
                  c["classes"])
    b, img = c["batch"], c["img"]
    return model, lambda g: (_randn(g, b, 3, img, img),), _labels(c["classes"], b), _ce


class WindowMLPBlock(nn.Module):
    """x + MLP(LayerNorm(x)), MLP = Linear(C, 4C) -> GELU -> Linear(4C, C)."""

    def __init__(self, dim, ratio=4):
        super().__init__()
        self.norm = nn.LayerNorm(dim)
        self.fc1, self.fc2 = nn.Linear(dim, ratio * dim), nn.Linear(ratio * dim, dim)

    def forward(self, x):
        return x + self.fc2(F.gelu(self.fc1(self.norm(x))))


class SwinWindowMLP(nn.Module):
    """Swin-style: a [B, H, W, C] feature map split into windows of w x w tokens flattened
    into the batch ([B * windows, w * w, C]), window MLP blocks on that, windows merged back."""

    def __init__(self, dim, window=7, depth=2):
        super().__init__()
        self.window = window
        self.blocks = nn.ModuleList(WindowMLPBlock(dim) for _ in range(depth))

    def forward(self, x):
        B, H, W, C = x.shape
        w = self.window
        x = x.view(B, H // w, w, W // w, w, C).permute(0, 1, 3, 2, 4, 5).reshape(-1, w * w, C)
        for block in self.blocks:
            x = block(x)
        x = x.view(B, H // w, W // w, w, w, C).permute(0, 1, 3, 2, 4, 5)
        return x.reshape(B, H, W, C)


def _swin(c):
    b, s, d = c["batch"], c["size"], c["dim"]
    return (SwinWindowMLP(d, c["window"], c["depth"]), lambda g: (_randn(g, b, s, s, d),),
            lambda g: _randn(g, b, s, s, d), _mse)


def _mlp(widths, last_relu):
    layers = []
    for i, (a, b) in enumerate(zip(widths, widths[1:])):
        layers.append(nn.Linear(a, b))
        if last_relu or i < len(widths) - 2:
            layers.append(nn.ReLU())
    return nn.Sequential(*layers)


class DLRM(nn.Module):
    """DLRM: bottom MLP over the dense features, one EmbeddingBag (sum over a multi-hot bag)
    per sparse feature, dot interaction (the pairwise dot products of the bottom output and
    the embeddings, strictly lower triangle), top MLP over [bottom output, interactions] to one
    logit."""

    def __init__(self, dense, bottom, top, tables, rows, bag):
        super().__init__()
        emb = bottom[-1]
        self.bottom = _mlp([dense, *bottom], last_relu=True)
        self.embeddings = nn.ModuleList(nn.EmbeddingBag(rows, emb, mode="sum")
                                        for _ in range(tables))
        for e in self.embeddings:  # the DLRM reference's initialisation
            nn.init.uniform_(e.weight, -rows ** -0.5, rows ** -0.5)
        n = tables + 1
        li, lj = torch.tril_indices(n, n, offset=-1)
        self.register_buffer("li", li, persistent=False)
        self.register_buffer("lj", lj, persistent=False)
        self.top = _mlp([emb + n * (n - 1) // 2, *top, 1], last_relu=False)

    def forward(self, dense, sparse):
        x = self.bottom(dense)
        feats = [x] + [e(sparse[:, i]) for i, e in enumerate(self.embeddings)]
        t = torch.stack(feats, dim=1)
        z = torch.bmm(t, t.transpose(1, 2))
        return self.top(torch.cat([x, z[:, self.li, self.lj]], dim=1))


def _dlrm(c):
    b, tables, rows, bag = c["batch"], c["tables"], c["rows"], c["bag"]
    model = DLRM(c["dense"], c["bottom"], c["top"], tables, rows, bag)

    def inputs(g):
        return (_uniform(g, b, c["dense"], lo=0.0, hi=1.0),
                torch.randint(0, rows, (b, tables, bag), generator=g))

    def loss(out, target):
        return F.binary_cross_entropy_with_logits(_upcast(out), target.to(_upcast(out).dtype))
    return model, inputs, lambda g: torch.randint(0, 2, (b, 1), generator=g).float(), loss


class NetVLAD(nn.Module):
    """NetVLAD head over local descriptors [B, N, D]: L2-normalised descriptors, soft assignment
    (Linear -> softmax over K clusters), aggregation of the residuals to the centroids,
    intra-normalisation per cluster, then L2 normalisation of the flattened [B, K * D]."""

    def __init__(self, dim=128, clusters=48):
        super().__init__()
        self.assign = nn.Linear(dim, clusters)
        self.centroids = nn.Parameter(torch.rand(clusters, dim))

    def forward(self, x):
        x = F.normalize(x, dim=2)
        a = F.softmax(self.assign(x), dim=2)
        vlad = torch.bmm(a.transpose(1, 2), x) - a.sum(dim=1).unsqueeze(2) * self.centroids
        vlad = F.normalize(vlad, dim=2)
        return F.normalize(vlad.flatten(1), dim=1)


def _netvlad(c):
    b, n, d, k = c["batch"], c["descriptors"], c["dim"], c["clusters"]
    return (NetVLAD(d, k), lambda g: (_randn(g, b, n, d),),
            lambda g: F.normalize(_randn(g, b, k * d), dim=1), _mse)


def _pinn(c):
    """PINN MLP: (x, y, t) -> u, tanh between every layer (no activation on the output)."""
    w, depth = c["width"], c["depth"]
    layers = [nn.Linear(3, w), nn.Tanh()]
    for _ in range(depth - 1):
        layers += [nn.Linear(w, w), nn.Tanh()]
    model = nn.Sequential(*layers, nn.Linear(w, 1))
    p = c["points"]
    return model, lambda g: (_uniform(g, p, 3),), lambda g: _randn(g, p, 1), _mse


def _deep_mlp(c):
    """Deep narrow MLP: depth x (Linear(width, width) + ReLU)."""
    w = c["width"]
    model = nn.Sequential(*(m for _ in range(c["depth"]) for m in (nn.Linear(w, w), nn.ReLU())))
    b = c["batch"]
    return model, lambda g: (_randn(g, b, w),), lambda g: _randn(g, b, w, scale=0.01), _mse


class SwiGLU(nn.Module):
    """LLaMA's feed-forward: w2(silu(w1 x) * w3 x), no biases."""

    def __init__(self, dim=4096, hidden=11008):
        super().__init__()
        self.w1 = nn.Linear(dim, hidden, bias=False)
        self.w3 = nn.Linear(dim, hidden, bias=False)
        self.w2 = nn.Linear(hidden, dim, bias=False)

    def forward(self, x):
        return self.w2(F.silu(self.w1(x)) * self.w3(x))


def _swiglu(c):
    b, t, d = c["batch"], c["seq"], c["dim"]
    return (SwiGLU(d, c["hidden"]), lambda g: (_randn(g, b, t, d),),
            lambda g: _randn(g, b, t, d, scale=0.1), _mse)


class LMHead(nn.Module):
    """GPT-2's output layer and loss (nanoGPT's): logits = lm_head(h), then cross-entropy
    against the next tokens; the forward returns the loss."""

    def __init__(self, dim=768, vocab=50257):
        super().__init__()
        self.lm_head = nn.Linear(dim, vocab, bias=False)

    def forward(self, h, targets):
        logits = self.lm_head(h)
        return F.cross_entropy(logits.view(-1, logits.size(-1)), targets.view(-1))


def _lm_head(c):
    b, t, d, v = c["batch"], c["seq"], c["dim"], c["vocab"]

    def inputs(g):
        return _randn(g, b, t, d), torch.randint(0, v, (b, t), generator=g)
    return LMHead(d, v), inputs, None, lambda out, _t: out


class RNNCell(nn.Module):
    """A hand-written Elman cell (PyTorch's char-RNN tutorial's) that keeps its hidden state
    as an attribute: each call reads it and replaces it. ``reset()`` puts back the initial
    state (a fixed random buffer, so that the state matters from the first step)."""

    def __init__(self, input_size, hidden_size, batch):
        super().__init__()
        self.i2h = nn.Linear(input_size + hidden_size, hidden_size)
        self.register_buffer("h0", torch.rand(batch, hidden_size) * 2 - 1, persistent=False)
        self.reset()

    def reset(self):
        self.hidden = self.h0

    def forward(self, x):
        self.hidden = torch.tanh(self.i2h(torch.cat((x, self.hidden), 1)))
        return self.hidden


def _rnn(c):
    b, i, h = c["batch"], c["input"], c["hidden"]
    return (RNNCell(i, h, b), lambda g: (_randn(g, b, i),),
            lambda g: _uniform(g, b, h, lo=-0.9, hi=0.9), _mse)


# ------------------------------------------------------------------------------- the registry
def _kinds(tiny, small, large):
    """The three kinds' configurations: small and large share the real widths."""
    return {"tiny": tiny, "small": small, "large": {**small, **large}}


_VIT = dict(img=224, patch=16, dim=384, heads=6, depth=12, mlp=1536, classes=1000)
_MIXER = dict(img=224, patch=16, dim=512, token_mlp=256, channel_mlp=2048, depth=8, classes=1000)
_DLRM = dict(dense=13, bottom=(512, 256, 64), top=(512, 256), tables=8, rows=100_000, bag=4)

ZOO = {z.name: z for z in (
    _entry("vit-s16", _vit, _kinds(
        dict(batch=2, img=32, patch=16, dim=32, heads=2, depth=2, mlp=64, classes=10),
        dict(_VIT, batch=1), dict(batch=32)),
        "ViT-S/16 on nn.TransformerEncoder (pre-LN, 12 layers, 384 wide, 6 heads, MLP 1536), "
        "224x224 images (197 tokens), 1000 classes, cross-entropy"),
    _entry("gpt2-block", _gpt2, _kinds(
        dict(batch=2, seq=8, dim=32, heads=2),
        dict(batch=1, seq=128, dim=768, heads=12), dict(batch=16, seq=1024)),
        "one GPT-2-small block (768 wide, 12 heads, causal SDPA, GELU(tanh) MLP 3072); small: "
        "a 128-token prompt, large: 16 sequences of 1024; MSE loss"),
    _entry("mingpt-block", _mingpt_block, _kinds(
        dict(batch=2, seq=8, dim=32, heads=2),
        dict(batch=1, seq=128, dim=768, heads=8), dict(batch=128, seq=512)),
        "one minGPT block (768 wide, 8 heads, attention written out with a causal masked_fill, "
        "GELU(tanh) MLP 3072); small: a 128-token prompt, large: 128 sequences of 512 (issue "
        "48's block shape); MSE loss", budget_ms=150.0),
    _entry("gpt2-small", _gpt2_small, _kinds(
        dict(batch=2, seq=8, vocab=64, ctx=16, dim=32, heads=2, layers=2),
        dict(batch=1, seq=128, vocab=50257, ctx=1024, dim=768, heads=12, layers=12),
        dict(batch=8, seq=1024)),
        "GPT-2-small (124M: 12 blocks as gpt2-block, 768 wide, vocab 50257, 1024 positions, LM "
        "head tied to the token embedding), next-token cross-entropy; small: a 128-token "
        "prompt, large: 8 sequences of 1024 (issue 48's training-step shape)", budget_ms=200.0),
    _entry("bert-layer", _bert, _kinds(
        dict(batch=2, seq=8, dim=32, heads=2, ffn=64),
        dict(batch=1, seq=128, dim=768, heads=12, ffn=3072), dict(batch=32, seq=512)),
        "one BERT-base encoder layer (768, 12 heads, FFN 3072, post-LN, no padding mask); "
        "small: one 128-token sequence, large: 32 of 512; MSE loss"),
    _entry("mixer-s16", _mixer, _kinds(
        dict(batch=2, img=32, patch=8, dim=32, token_mlp=16, channel_mlp=64, depth=2, classes=10),
        dict(_MIXER, batch=1), dict(batch=64)),
        "MLP-Mixer-S/16 (196 patches, 512 channels, token MLP 256, channel MLP 2048, 8 "
        "layers), 224x224 images, cross-entropy"),
    _entry("swin-mlp", _swin, _kinds(
        dict(batch=1, size=14, dim=16, window=7, depth=2),
        dict(batch=1, size=28, dim=192, window=7, depth=2), dict(batch=128)),
        "Swin-T stage-2 shape: 28x28 map, C=192, 7x7 windows flattened into the batch, 2 "
        "blocks of LayerNorm + MLP 4x (window attention left out); MSE loss"),
    _entry("dlrm", _dlrm, _kinds(
        dict(batch=4, dense=13, bottom=(16, 8), top=(16,), tables=2, rows=50, bag=2),
        dict(_DLRM, batch=32), dict(batch=65536)),
        "DLRM: bottom MLP 13-512-256-64, 8 EmbeddingBag tables of 100k x 64 (sum over 4 ids), "
        "dot interaction (36 pairs), top MLP 100-512-256-1; BCE with logits"),
    _entry("netvlad", _netvlad, _kinds(
        dict(batch=2, descriptors=16, dim=8, clusters=4),
        dict(batch=1, descriptors=784, dim=128, clusters=48), dict(batch=64, descriptors=3136)),
        "NetVLAD head, 48 clusters over 128-d descriptors; small: one 28x28 map, large: 64 "
        "56x56 maps (200,704 descriptors); MSE loss to a unit target"),
    _entry("pinn", _pinn, _kinds(
        dict(points=8, width=16, depth=3),
        dict(points=256, width=256, depth=8), dict(points=16384)),
        "PINN MLP (x, y, t) -> u: 8 tanh layers 256 wide, then Linear(256, 1); small: 256 "
        "points, large: 16k collocation points; MSE loss (no PDE residual)"),
    _entry("deep-mlp", _deep_mlp, _kinds(
        dict(batch=4, width=32, depth=4),
        dict(batch=8, width=1024, depth=16), dict(batch=1024)),
        "deep narrow MLP: 16 x (Linear(1024, 1024) + ReLU); MSE loss"),
    _entry("swiglu", _swiglu, _kinds(
        dict(batch=1, seq=4, dim=32, hidden=64),
        dict(batch=1, seq=8, dim=4096, hidden=11008), dict(batch=4, seq=512)),
        "LLaMA-7B's SwiGLU MLP (4096 -> 11008 -> 4096, no biases); small: 8 tokens (decode), "
        "large: 4 x 512 tokens; MSE loss"),
    _entry("lm-head", _lm_head, _kinds(
        dict(batch=1, seq=8, dim=16, vocab=50),
        dict(batch=1, seq=32, dim=768, vocab=50257), dict(batch=4, seq=1024)),
        "GPT-2 LM head with cross-entropy (768 -> 50257, no bias): the forward returns the "
        "loss; small: 32 tokens, large: 4096"),
    _entry("rnn-cell", _rnn, _kinds(
        dict(batch=4, input=8, hidden=16),
        dict(batch=8, input=256, hidden=1024), dict(batch=16384)),
        "stateful Elman cell: self.hidden = tanh(i2h(cat(x, self.hidden))), hidden 1024, "
        "input 256; reset() before each sequence, the training step is one step; MSE loss"),
)}


def count(entry: ZooModel, kind: str) -> dict:
    """Parameters and forward FLOPs (torch's FlopCounterMode: matmuls, convolutions,
    attention) of `entry` at `kind`, built on the meta device (no memory, no compute); the
    estimated eager fp32 training step on an H100 at ~50 TFLOP/s (3x the forward's FLOPs)."""
    from torch.utils.flop_counter import FlopCounterMode
    model, make_inputs, _ = entry.build(kind, "meta")
    model.train()  # nn.TransformerEncoder's inference fast path is one op the counter skips
    with FlopCounterMode(display=False) as fc, torch.no_grad():
        model(*make_inputs(0))
    flops = fc.get_total_flops()
    return {"params": sum(p.numel() for p in model.parameters()), "flops_forward": flops,
            "est_ms_fp32_train_h100": 3 * flops / 50e12 * 1e3}
