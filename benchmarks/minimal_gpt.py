"""A minimal GPT in plain PyTorch: the baseline course_lib's character-level model is timed
against (``python -m benchmarks.compare_char_lm``).

It is written the way a practitioner writes a small GPT (in the spirit of nanoGPT's
``model.py``), with no course_lib import: token + learned position embeddings, pre-norm blocks
(``x = x + attn(ln_1(x))``, ``x = x + mlp(ln_2(x))``) with ``nn.LayerNorm``, a fused qkv
projection, ``F.scaled_dot_product_attention(is_causal=True)``, a GELU MLP, a final LayerNorm
and an output layer tied to the token embedding; GPT-2's initialisation; AdamW with weight
decay on the weight matrices and a warm-up + cosine learning rate. The update itself (with
gradient clipping) is written once in the benchmark, for both models
(``compare_char_lm.update_parts``).

It computes the same function as course_lib's decoder at the benchmark's configuration, so the
two can start from the same weights (:func:`copy_course_weights`) and their speeds compared
update for update. What it leaves out on purpose: dropout (the benchmark trains without it),
argument checks, other position schemes, attention weights, padding, generation.

Shape legend: B batch, T length, D d_model, H heads, Dh = D / H, V vocabulary.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn


@dataclass(frozen=True)
class GPTConfig:
    """Sizes of a :class:`MinimalGPT`.

    ``bias`` switches the biases of the linear layers; the LayerNorms keep nn.LayerNorm's
    gain and shift either way (as course_lib's do). ``gelu_approximate`` is ``"none"`` for the
    exact erf GELU (course_lib's ``"gelu"``) or ``"tanh"`` for GPT-2's form.
    """

    vocab_size: int
    block_size: int = 64
    n_layer: int = 4
    n_head: int = 4
    n_embd: int = 128
    bias: bool = False
    gelu_approximate: str = "none"


class CausalSelfAttention(nn.Module):
    def __init__(self, config: GPTConfig) -> None:
        super().__init__()
        self.n_head = config.n_head
        self.qkv = nn.Linear(config.n_embd, 3 * config.n_embd, bias=config.bias)  # [W_q; W_k; W_v]
        self.proj = nn.Linear(config.n_embd, config.n_embd, bias=config.bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        B, T, D = x.shape
        q, k, v = self.qkv(x).split(D, dim=2)  # 3 x (B, T, D)
        q = q.view(B, T, self.n_head, D // self.n_head).transpose(1, 2)  # (B, H, T, Dh)
        k = k.view(B, T, self.n_head, D // self.n_head).transpose(1, 2)  # (B, H, T, Dh)
        v = v.view(B, T, self.n_head, D // self.n_head).transpose(1, 2)  # (B, H, T, Dh)
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)  # (B, H, T, Dh)
        y = y.transpose(1, 2).contiguous().view(B, T, D)  # (B, T, D)
        return self.proj(y)


class MLP(nn.Module):
    def __init__(self, config: GPTConfig) -> None:
        super().__init__()
        self.fc = nn.Linear(config.n_embd, 4 * config.n_embd, bias=config.bias)
        self.proj = nn.Linear(4 * config.n_embd, config.n_embd, bias=config.bias)
        self.approximate = config.gelu_approximate

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.proj(F.gelu(self.fc(x), approximate=self.approximate))


class Block(nn.Module):
    def __init__(self, config: GPTConfig) -> None:
        super().__init__()
        self.ln_1 = nn.LayerNorm(config.n_embd)
        self.attn = CausalSelfAttention(config)
        self.ln_2 = nn.LayerNorm(config.n_embd)
        self.mlp = MLP(config)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.ln_1(x))
        x = x + self.mlp(self.ln_2(x))
        return x


class MinimalGPT(nn.Module):
    """A GPT language model: ``model(idx, targets)`` returns ``(logits, loss)``.

    Shapes:
        forward(idx: (B, T), targets: (B, T) or None) -> (logits (B, T, V), loss or None)
    """

    def __init__(self, config: GPTConfig) -> None:
        super().__init__()
        self.config = config
        self.wte = nn.Embedding(config.vocab_size, config.n_embd)
        self.wpe = nn.Embedding(config.block_size, config.n_embd)
        self.blocks = nn.ModuleList(Block(config) for _ in range(config.n_layer))
        self.ln_f = nn.LayerNorm(config.n_embd)
        self.lm_head = nn.Linear(config.n_embd, config.vocab_size, bias=False)
        self.lm_head.weight = self.wte.weight  # tied: one (V, D) matrix
        self.apply(self._init_weights)
        # GPT-2: the projections that write into the residual stream get std / sqrt(2 L)
        for name, p in self.named_parameters():
            if name.endswith("proj.weight"):
                nn.init.normal_(p, mean=0.0, std=0.02 / math.sqrt(2 * config.n_layer))

    @staticmethod
    def _init_weights(module: nn.Module) -> None:
        if isinstance(module, nn.Linear):
            nn.init.normal_(module.weight, mean=0.0, std=0.02)
            if module.bias is not None:
                nn.init.zeros_(module.bias)
        elif isinstance(module, nn.Embedding):
            nn.init.normal_(module.weight, mean=0.0, std=0.02)

    def forward(
        self, idx: torch.Tensor, targets: torch.Tensor | None = None
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        T = idx.shape[1]
        pos = torch.arange(T, device=idx.device)  # (T,)
        x = self.wte(idx) + self.wpe(pos)  # (B, T, D)
        for block in self.blocks:
            x = block(x)
        logits = self.lm_head(self.ln_f(x))  # (B, T, V)
        loss = None
        if targets is not None:
            loss = F.cross_entropy(logits.view(-1, logits.size(-1)), targets.reshape(-1))
        return logits, loss


def configure_optimizer(
    model: nn.Module, *, lr: float, weight_decay: float, betas: tuple[float, float]
) -> torch.optim.AdamW:
    """AdamW with weight decay on the weight matrices only.

    Biases and LayerNorm parameters (1-D) are not decayed, and neither are the embedding tables
    (the tied output layer shares the token table): the same split as course_lib's
    ``param_groups``, so both models follow the same update rule. The fused kernel is used on
    CUDA only, as nanoGPT does.
    """
    embeddings = {id(m.weight) for m in model.modules() if isinstance(m, nn.Embedding)}
    params = list(model.parameters())  # a tied tensor appears once
    decay = [p for p in params if p.dim() >= 2 and id(p) not in embeddings]
    no_decay = [p for p in params if p.dim() < 2 or id(p) in embeddings]
    groups = [
        {"params": decay, "weight_decay": weight_decay},
        {"params": no_decay, "weight_decay": 0.0},
    ]
    fused = params[0].device.type == "cuda"
    return torch.optim.AdamW(groups, lr=lr, betas=betas, fused=fused)


def get_lr(step: int, *, lr: float, min_lr: float, warmup_iters: int, decay_iters: int) -> float:
    """Learning rate of update ``step`` (0-based): linear warm-up to ``lr`` over
    ``warmup_iters`` updates, then a cosine down to ``min_lr``, reached at update
    ``decay_iters - 1`` (the same schedule as course_lib's ``TrainConfig``)."""
    if step < warmup_iters:
        return lr * (step + 1) / warmup_iters
    if step >= decay_iters - 1:
        return min_lr
    progress = (step + 1 - warmup_iters) / (decay_iters - warmup_iters)
    return min_lr + 0.5 * (1.0 + math.cos(math.pi * progress)) * (lr - min_lr)


# course_lib parameter name -> MinimalGPT parameter name, for one block ({i} = block index)
_BLOCK_NAMES = {
    "self_attn.qkv_proj.weight": "attn.qkv.weight",
    "self_attn.qkv_proj.bias": "attn.qkv.bias",
    "self_attn.out_proj.weight": "attn.proj.weight",
    "self_attn.out_proj.bias": "attn.proj.bias",
    "self_attn_addnorm.norm.weight": "ln_1.weight",
    "self_attn_addnorm.norm.bias": "ln_1.bias",
    "ff.fc1.weight": "mlp.fc.weight",
    "ff.fc1.bias": "mlp.fc.bias",
    "ff.fc2.weight": "mlp.proj.weight",
    "ff.fc2.bias": "mlp.proj.bias",
    "ff_addnorm.norm.weight": "ln_2.weight",
    "ff_addnorm.norm.bias": "ln_2.bias",
    # the same after course_lib's restructuring (blocks hold their nn.LayerNorms directly)
    "attn_norm.weight": "ln_1.weight",
    "attn_norm.bias": "ln_1.bias",
    "ff_norm.weight": "ln_2.weight",
    "ff_norm.bias": "ln_2.bias",
}
_TOP_NAMES = {
    "embeddings.token.weight": "wte.weight",
    "embeddings.position.embedding.weight": "wpe.weight",
    "final_norm.weight": "ln_f.weight",
    "final_norm.bias": "ln_f.bias",
    "lm_head.weight": "lm_head.weight",
}


@torch.no_grad()
def copy_course_weights(model: MinimalGPT, course_model: nn.Module) -> None:
    """Load a course_lib decoder's weights (learned positions, pre-norm, tied) into ``model``,
    so both start from the same point. Raises ``KeyError`` naming any parameter it cannot
    place (the course's names changed, or the architectures differ)."""
    ours = dict(model.named_parameters(remove_duplicate=False))
    filled = set()
    for name, value in course_model.named_parameters(remove_duplicate=False):
        target = _TOP_NAMES.get(name)
        if target is None and name.startswith("blocks."):
            _, index, rest = name.split(".", 2)
            if rest in _BLOCK_NAMES:
                target = f"blocks.{index}.{_BLOCK_NAMES[rest]}"
        if target is None or target not in ours or ours[target].shape != value.shape:
            raise KeyError(
                f"no place in MinimalGPT for course parameter {name} {tuple(value.shape)}"
            )
        ours[target].copy_(value)
        filled.add(target)
    missing = sorted(set(ours) - filled)
    if missing:
        raise KeyError(f"MinimalGPT parameters not given by the course model: {missing}")
