"""A tiny causal transformer whose Linear layers can fail like bad hardware.

`FaultableLinear` reads a per-process switch (`set_sdc`): when its qualified name is the target, every output it
computes has one element corrupted (the lowest exponent bit of element `elem` of the flattened output flipped, the
value doubles or halves; `elem` < 0 counts from the end). Element 0 of an attention's qkv output is the query of
position 0, which causal attention ignores (its only key gets weight 1): that fault changes nothing, so the
campaign draws elements of the last position instead.
The fault is deterministic and lives in the process, not in the module, so it survives `copy.deepcopy` and shows
up again when a replay runner re-executes a copy of the layer -- as a failing multiplier would. The corruption is
finite on purpose: the job keeps training and only replay/consensus evidence can tell.
"""

from __future__ import annotations

import math

import torch
import torch.nn as nn
import torch.nn.functional as F

_SDC_TARGET: str | None = None  # qualified name of the Linear that computes wrongly in this process
_SDC_ELEM = 0  # which element of its flattened output (negative: from the end)
_EXP_LSB = 1 << 23  # lowest exponent bit of a float32


def set_sdc(target: str | None, elem: int = 0) -> None:
    """Make the FaultableLinear named `target` (e.g. "blocks.1.mlp.fc1") corrupt element `elem` of its output
    from now on."""
    global _SDC_TARGET, _SDC_ELEM
    _SDC_TARGET, _SDC_ELEM = target, elem


def sdc_target() -> str | None:
    return _SDC_TARGET


class FaultableLinear(nn.Linear):
    fault_name: str = ""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = super().forward(x)
        if _SDC_TARGET is not None and self.fault_name == _SDC_TARGET:
            out = _corrupt(out)
        return out


def _corrupt(out: torch.Tensor) -> torch.Tensor:
    # Keep autograd intact: add the (detached) error to one element, so gradients flow as through the real op.
    i = _SDC_ELEM % out.numel()
    flat = out.detach().reshape(-1)[i : i + 1].float()
    bad = (flat.view(torch.int32) ^ _EXP_LSB).view(torch.float32).to(out.dtype)
    delta = torch.zeros_like(out).reshape(-1)
    delta[i : i + 1] = bad - flat.to(out.dtype)
    return out + delta.view_as(out)


class Attention(nn.Module):
    def __init__(self, d_model: int, n_heads: int):
        super().__init__()
        self.n_heads = n_heads
        self.qkv = FaultableLinear(d_model, 3 * d_model, bias=False)
        self.proj = FaultableLinear(d_model, d_model, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, d = x.shape
        q, k, v = self.qkv(x).view(b, t, 3, self.n_heads, d // self.n_heads).unbind(2)
        y = F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), is_causal=True)
        return self.proj(y.transpose(1, 2).reshape(b, t, d))


class MLP(nn.Module):
    def __init__(self, d_model: int):
        super().__init__()
        self.fc1 = FaultableLinear(d_model, 4 * d_model, bias=False)
        self.fc2 = FaultableLinear(4 * d_model, d_model, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(F.gelu(self.fc1(x)))


class Block(nn.Module):
    """Pre-norm residual block."""

    def __init__(self, d_model: int, n_heads: int):
        super().__init__()
        self.norm1 = nn.LayerNorm(d_model)
        self.attn = Attention(d_model, n_heads)
        self.norm2 = nn.LayerNorm(d_model)
        self.mlp = MLP(d_model)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.norm1(x))
        return x + self.mlp(self.norm2(x))


class TinyTransformer(nn.Module):
    def __init__(self, vocab: int = 256, d_model: int = 64, n_heads: int = 4, n_blocks: int = 4, seq_len: int = 32):
        super().__init__()
        self.seq_len = seq_len
        self.embedding = nn.Embedding(vocab, d_model)
        self.pos = nn.Parameter(torch.zeros(seq_len, d_model))
        self.blocks = nn.ModuleList(Block(d_model, n_heads) for _ in range(n_blocks))
        self.norm = nn.LayerNorm(d_model)
        self.head = FaultableLinear(d_model, vocab, bias=False)
        self.apply(_init)
        for name, mod in self.named_modules():
            if isinstance(mod, FaultableLinear):
                mod.fault_name = name
        # Sphere radii are fixed at init, before any sharding, so every rank agrees on them.
        self.sphere_radii = {name: float(p.detach().norm()) for name, p in self.sphere_params()}

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        x = self.embedding(tokens) + self.pos[: tokens.shape[1]]
        for block in self.blocks:
            x = block(x)
        return self.head(self.norm(x))

    def sphere_params(self):
        """The blocks' 2-D weight matrices: the ones `--constraint sphere` keeps on a Frobenius sphere."""
        for name, p in self.named_parameters():
            if name.startswith("blocks.") and p.ndim == 2:
                yield name, p

    def linear_names(self) -> list[str]:
        return [n for n, m in self.named_modules() if isinstance(m, FaultableLinear)]


def _init(mod: nn.Module) -> None:
    if isinstance(mod, nn.Linear):
        nn.init.normal_(mod.weight, std=1.0 / math.sqrt(mod.in_features))
    elif isinstance(mod, nn.Embedding):
        nn.init.normal_(mod.weight, std=1.0)


def _norm(p: torch.Tensor) -> float:
    """Frobenius norm of a plain tensor or a (sharded) DTensor; the DTensor case is a collective."""
    n = torch.linalg.vector_norm(p.detach())
    if hasattr(n, "full_tensor"):
        n = n.full_tensor()
    return float(n)


@torch.no_grad()
def retract_to_sphere(model: TinyTransformer) -> None:
    """Rescale every sphere parameter back to its init radius (the retraction after an optimizer step).
    Collective under FSDP: every rank must call it."""
    for name, p in model.sphere_params():
        p.mul_(model.sphere_radii[name] / max(_norm(p), 1e-12))


def sphere_deviation(model: TinyTransformer) -> float:
    """Largest relative distance of a sphere parameter from its radius (0 when the constraint holds)."""
    return max(abs(_norm(p) / model.sphere_radii[n] - 1.0) for n, p in model.sphere_params())
