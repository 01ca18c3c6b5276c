"""RMSNorm: x / sqrt(mean(x^2) + eps) * weight. It is computed as Hugging Face's Llama computes it.
So float32 results are bit-identical, and bfloat16 ones round the same way. `norm_heads` is Qwen3's
q/k norm, the same RMSNorm over each attention head. `GemmaRMSNorm` is Gemma's. It scales by
(1 + weight), in float32."""

import torch
from torch import Tensor, nn


def normalize(x: Tensor, eps: float) -> Tensor:
    """x / sqrt(mean(x^2) + eps) in float32: bf16 would lose the mean of squares."""
    x32 = x.float()
    return x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps)


class RMSNorm(nn.Module):
    def __init__(self, hidden_size: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(hidden_size))
        self.eps = eps

    def forward(self, x: Tensor) -> Tensor:
        return self.weight * normalize(x, self.eps).to(x.dtype)  # cast back before the weight, as HF does


class GemmaRMSNorm(RMSNorm):
    """Gemma's RMSNorm: x / sqrt(mean(x^2) + eps) * (1 + weight). The checkpoint stores weight - 1 (zeros at
    init). Unlike Llama's, the weight multiplies in float32 and the product is cast back, as HF's Gemma does."""

    def forward(self, x: Tensor) -> Tensor:
        return (normalize(x, self.eps) * (1.0 + self.weight.float())).to(x.dtype)


def norm_heads(qk: Tensor, num_heads: int, q_norm: RMSNorm, k_norm: RMSNorm) -> Tensor:
    """Qwen3's q/k norm on q's and k's heads side by side, `[N, H + Hkv, D]` (H = `num_heads`).
    It is an RMSNorm over each head's D dims. q's heads use q_norm's `[D]` weight, and k's use k_norm's."""
    return torch.cat([q_norm(qk[:, :num_heads]), k_norm(qk[:, num_heads:])], dim=1)  # [N, H + Hkv, D]
