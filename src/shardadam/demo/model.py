"""A small decoder-only transformer over byte tokens (GPT-style, pre-norm).

Its blocks are the units ``fully_shard`` wraps (see ``worker``); sizes are in
``config.SIZES``.
"""

import math

import torch
import torch.nn.functional as F
from torch import nn

from .config import ModelSize


class Block(nn.Module):
    def __init__(self, dim, heads):
        super().__init__()
        self.heads = heads
        self.norm1 = nn.LayerNorm(dim)
        self.qkv = nn.Linear(dim, 3 * dim)
        self.proj = nn.Linear(dim, dim)
        self.norm2 = nn.LayerNorm(dim)
        self.fc = nn.Linear(dim, 4 * dim)
        self.out = nn.Linear(4 * dim, dim)

    def forward(self, x):
        batch, length, dim = x.shape
        q, k, v = self.qkv(self.norm1(x)).split(dim, dim=-1)
        q, k, v = (t.view(batch, length, self.heads, dim // self.heads).transpose(1, 2)
                   for t in (q, k, v))
        attn = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.proj(attn.transpose(1, 2).reshape(batch, length, dim))
        return x + self.out(F.gelu(self.fc(self.norm2(x))))


class Transformer(nn.Module):
    def __init__(self, vocab_size, size: ModelSize):
        super().__init__()
        self.embed = nn.Embedding(vocab_size, size.dim)
        self.pos = nn.Embedding(size.seq_len, size.dim)
        self.blocks = nn.ModuleList(Block(size.dim, size.heads) for _ in range(size.layers))
        self.norm = nn.LayerNorm(size.dim)
        self.head = nn.Linear(size.dim, vocab_size, bias=False)
        self._init_weights(size.layers)

    def _init_weights(self, layers):
        for name, param in self.named_parameters():
            if "norm" in name:
                continue  # LayerNorm keeps its (1, 0) start
            if param.dim() < 2:
                nn.init.zeros_(param)
                continue
            std = 0.02
            if name.endswith(("proj.weight", "out.weight")):
                std /= math.sqrt(2 * layers)  # residual branches: keep the sum's scale
            nn.init.normal_(param, std=std)

    def forward(self, tokens):
        positions = torch.arange(tokens.shape[1], device=tokens.device)
        x = self.embed(tokens) + self.pos(positions)
        for block in self.blocks:
            x = block(x)
        return self.head(self.norm(x))
