"""RMSNorm: x / sqrt(mean(x^2) + eps) * weight, computed as Hugging Face's Llama computes it, so
float32 results are bit-identical and bfloat16 ones round the same way."""
from __future__ import annotations

import torch
from torch import nn


class RMSNorm(nn.Module):
    def __init__(self, hidden_size: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(hidden_size))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # float32 for the mean of squares (bf16 would lose it); cast back before the weight, as HF does
        x32 = x.float()
        x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * x32.to(x.dtype)
