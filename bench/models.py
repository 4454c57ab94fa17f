"""The five seed models (docs/models.md), written from their description.

Each class is built as ``Cls(*Cls.get_init_inputs())`` and called as
``model(*Cls.get_inputs())``. Modules stay in PyTorch's default training mode with default
initialisation; inputs are ``torch.rand`` (uniform [0, 1)). The seed shapes are batch 1024,
in 8192, out 8192; every one of them can be overridden.

``MODELS`` maps an id to a :class:`ModelSpec` whose ``make(...)`` returns ``(model, inputs)``.
"""
from __future__ import annotations

import math
import zlib
from dataclasses import dataclass

import torch
import torch.nn as nn
import torch.nn.functional as F

BATCH, IN_FEATURES, OUT_FEATURES = 1024, 8192, 8192
GROUPS = 256


def _rand_inputs(batch, in_features, dtype=torch.float32, device="cpu"):
    return [torch.rand(batch, in_features, dtype=dtype, device=device)]


class _Seed(nn.Module):
    """Shared helpers: default init args and inputs at the seed shapes."""

    @classmethod
    def get_init_inputs(cls, in_features=IN_FEATURES, out_features=OUT_FEATURES):
        return [in_features, out_features]

    @classmethod
    def get_inputs(cls, batch=BATCH, in_features=IN_FEATURES, dtype=torch.float32, device="cpu"):
        return _rand_inputs(batch, in_features, dtype, device)


class M18(_Seed):
    """Linear -> sum -> max -> mean -> logsumexp -> logsumexp (all dim=1, keepdim); [B,1]."""

    def __init__(self, in_features, out_features):
        super().__init__()
        self.linear = nn.Linear(in_features, out_features)

    def forward(self, x):
        x = self.linear(x)
        x = torch.sum(x, dim=1, keepdim=True)
        x = torch.max(x, dim=1, keepdim=True).values
        x = torch.mean(x, dim=1, keepdim=True)
        x = torch.logsumexp(x, dim=1, keepdim=True)
        x = torch.logsumexp(x, dim=1, keepdim=True)
        return x


class M22(_Seed):
    """Linear -> *scale -> x+x -> clamp -> logsumexp(dim=1, keepdim) -> x*mish(x); [B,1]."""

    def __init__(self, input_size, hidden_size, scale_factor, clamp_min, clamp_max):
        super().__init__()
        self.matmul = nn.Linear(input_size, hidden_size)
        self.scale_factor = scale_factor
        self.clamp_min = clamp_min
        self.clamp_max = clamp_max

    @classmethod
    def get_init_inputs(cls, in_features=IN_FEATURES, out_features=OUT_FEATURES):
        return [in_features, out_features, 2.0, -10.0, 10.0]

    def forward(self, x):
        x = self.matmul(x)
        x = x * self.scale_factor
        x = x + x
        x = torch.clamp(x, self.clamp_min, self.clamp_max)
        x = torch.logsumexp(x, dim=1, keepdim=True)
        x = x * F.mish(x)
        return x


class M84(_Seed):
    """Linear -> BatchNorm1d (training) -> scale*x -> softmax(dim=1); [B,N]."""

    def __init__(self, in_features, out_features, bn_eps=1e-5, bn_momentum=0.1, scale_shape=(1,)):
        super().__init__()
        self.gemm = nn.Linear(in_features, out_features)
        self.bn = nn.BatchNorm1d(out_features, eps=bn_eps, momentum=bn_momentum)
        self.scale = nn.Parameter(torch.ones(scale_shape))

    @classmethod
    def get_init_inputs(cls, in_features=IN_FEATURES, out_features=OUT_FEATURES):
        return [in_features, out_features, 1e-5, 0.1, (1,)]

    def forward(self, x):
        x = self.gemm(x)
        x = self.bn(x)
        x = self.scale * x
        return torch.softmax(x, dim=1)


def model_seed(base: int, name: str) -> int:
    """The torch seed for a model's (or suite problem's) weights and inputs: from its name, so
    that a model draws the same numbers whichever others a run includes (seeding by position in
    --models gave m94 other weights with three models than with five, and another gradient
    verdict)."""
    return base + zlib.crc32(name.encode()) % 10_000


def default_groups(out_features, groups=GROUPS):
    """256 groups when they divide N (the seed), else the largest divisor of N that divides 256."""
    return groups if out_features % groups == 0 else math.gcd(out_features, groups)


class M94(_Seed):
    """Linear -> +bias (randn, N) -> Hardtanh -> Mish -> GroupNorm(groups, N); [B,N]."""

    def __init__(self, in_features, out_features, bias_shape, num_groups):
        super().__init__()
        self.gemm = nn.Linear(in_features, out_features)
        self.bias = nn.Parameter(torch.randn(bias_shape))
        self.hardtanh = nn.Hardtanh()
        self.mish = nn.Mish()
        self.groupnorm = nn.GroupNorm(num_groups=num_groups, num_channels=out_features)

    @classmethod
    def get_init_inputs(cls, in_features=IN_FEATURES, out_features=OUT_FEATURES, groups=None):
        groups = default_groups(out_features) if groups is None else groups
        return [in_features, out_features, (out_features,), groups]

    def forward(self, x):
        x = self.gemm(x)
        x = x + self.bias
        x = self.hardtanh(x)
        x = self.mish(x)
        return self.groupnorm(x)


class M99(_Seed):
    """Linear -> gelu (erf) -> softmax(dim=1); [B,N]."""

    def __init__(self, in_features, out_features):
        super().__init__()
        self.linear = nn.Linear(in_features, out_features)

    def forward(self, x):
        x = self.linear(x)
        x = F.gelu(x)
        return F.softmax(x, dim=1)


@dataclass(frozen=True)
class ModelSpec:
    id: str
    cls: type
    summary: str
    out_is_row: bool  # output [B,1] instead of [B,N]

    def make(self, batch=None, in_features=None, out_features=None,
             dtype=torch.float32, device="cpu"):
        """Build the model (training mode, default init) and one set of inputs."""
        batch = BATCH if batch is None else batch
        k = IN_FEATURES if in_features is None else in_features
        n = OUT_FEATURES if out_features is None else out_features
        model = self.cls(*self.cls.get_init_inputs(k, n)).to(device=device, dtype=dtype)
        return model, self.cls.get_inputs(batch, k, dtype=dtype, device=device)

    def flops_bytes(self, batch, k, n, elem=4):
        """Work the model must do at least as a GEMM plus epilogue (see bench for floors)."""
        flops = 2 * batch * n * k
        out_cols = 1 if self.out_is_row else n
        bytes_ = elem * (batch * k + n * k + n + batch * out_cols)
        return flops, bytes_


MODELS = {
    "m18": ModelSpec("m18", M18, "Linear→sum→max→mean→logsumexp→logsumexp", True),
    "m22": ModelSpec("m22", M22, "Linear→×2→x+x→clamp→logsumexp→x·mish(x)", True),
    "m84": ModelSpec("m84", M84, "Linear→BatchNorm1d(train)→scale·x→softmax", False),
    "m94": ModelSpec("m94", M94, "Linear→+bias→Hardtanh→Mish→GroupNorm(256)", False),
    "m99": ModelSpec("m99", M99, "Linear→gelu→softmax", False),
}


# --------------------------------------------------------------------------------------------
# A transformer block in minGPT's style: pre-norm attention and MLP with residuals. Its
# forward reads the input's shape (`B, T, C = x.size()`), which torch.fx cannot trace, so
# gemmfuse.optimize captures it through dynamo.


class CausalSelfAttention(nn.Module):
    """minGPT's attention: explicit scores, causal mask, softmax, weighted values."""

    def __init__(self, n_embd: int, n_head: int, block_size: int = 1024, dropout: float = 0.0):
        super().__init__()
        assert n_embd % n_head == 0
        self.c_attn = nn.Linear(n_embd, 3 * n_embd)
        self.c_proj = nn.Linear(n_embd, n_embd)
        self.attn_dropout = nn.Dropout(dropout)
        self.resid_dropout = nn.Dropout(dropout)
        self.register_buffer("bias", torch.tril(torch.ones(block_size, block_size))
                             .view(1, 1, block_size, block_size), persistent=False)
        self.n_head, self.n_embd = n_head, n_embd

    def forward(self, x):
        B, T, C = x.size()
        q, k, v = self.c_attn(x).split(self.n_embd, dim=2)
        k = k.view(B, T, self.n_head, C // self.n_head).transpose(1, 2)
        q = q.view(B, T, self.n_head, C // self.n_head).transpose(1, 2)
        v = v.view(B, T, self.n_head, C // self.n_head).transpose(1, 2)
        att = (q @ k.transpose(-2, -1)) * (1.0 / math.sqrt(k.size(-1)))
        att = att.masked_fill(self.bias[:, :, :T, :T] == 0, float("-inf"))
        att = self.attn_dropout(F.softmax(att, dim=-1))
        y = (att @ v).transpose(1, 2).contiguous().view(B, T, C)
        return self.resid_dropout(self.c_proj(y))


class GPTBlock(nn.Module):
    """x + attn(ln_1(x)), then + mlp(ln_2(x)); the MLP is Linear -> GELU(tanh) -> Linear."""

    def __init__(self, n_embd: int = 768, n_head: int = 8, block_size: int = 1024,
                 dropout: float = 0.0):
        super().__init__()
        self.ln_1 = nn.LayerNorm(n_embd)
        self.attn = CausalSelfAttention(n_embd, n_head, block_size, dropout)
        self.ln_2 = nn.LayerNorm(n_embd)
        self.mlp = nn.ModuleDict(dict(c_fc=nn.Linear(n_embd, 4 * n_embd),
                                      act=nn.GELU(approximate="tanh"),
                                      c_proj=nn.Linear(4 * n_embd, n_embd),
                                      dropout=nn.Dropout(dropout)))

    def forward(self, x):
        x = x + self.attn(self.ln_1(x))
        m = self.mlp
        return x + m.dropout(m.c_proj(m.act(m.c_fc(self.ln_2(x)))))
