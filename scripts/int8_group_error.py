"""What smaller int8 scale groups would buy in agreement with float32, before any kernel runs them.

    python scripts/int8_group_error.py SMOLLM2_FOLDER

transformers' model of the folder runs in float32 with every linear's weight (lm_head's too) replaced by
its int8 round trip: one scale per row (nanoserve's rule, the only one torch's CPU kernel
`_weight_int8pack_mm` takes), or one per group of 64 or 32 weights of a row (llama.cpp's Q8_0: 32).
Scored on both passages of scripts/quantization_error.py, each position on the true prefix: how often the
most likely next token is float32's, the mean KL divergence from float32's distribution, and the
perplexity. Float32 activations throughout, so the differences are the weights' alone.
"""
from __future__ import annotations

import argparse
import math

import torch
from quantization_error import read_preamble
from torch import nn
from transformers import AutoModelForCausalLM, AutoTokenizer

from nanoserve.benchmarks.spec_decode import PASSAGE


def round_trip(weight: torch.Tensor, group: int | None) -> torch.Tensor:
    """weight [out, in] quantized to int8, symmetric, one scale per `group` weights of a row (None: per
    row), and dequantized, in float32."""
    out, in_ = weight.shape
    groups = weight.float().reshape(out, in_ // (group or in_), group or in_)  # [out, groups, group]
    scale = groups.abs().amax(dim=-1, keepdim=True) / 127
    scale = torch.where(scale > 0, scale, torch.ones_like(scale))
    return (torch.round(groups / scale).clamp(-127, 127) * scale).reshape(out, in_)


@torch.no_grad()
def log_probs(path: str, group: int | None | str, texts: list[torch.Tensor]) -> list[torch.Tensor]:
    """The model's log-probabilities [tokens, vocab] of each text, its linears round-tripped by `group`
    ("float32": left as they are)."""
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    model.config.tie_word_embeddings = False
    model.lm_head.weight = nn.Parameter(model.lm_head.weight.detach().clone())  # its own copy, as in the engine
    for module in model.modules():
        if isinstance(module, nn.Linear) and group != "float32":
            module.weight.copy_(round_trip(module.weight, group))
    return [model(ids[None]).logits[0].log_softmax(-1) for ids in texts]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("model")
    args = parser.parse_args()
    tokenizer = AutoTokenizer.from_pretrained(args.model)
    texts = [torch.tensor(tokenizer(text).input_ids) for text in (read_preamble(), PASSAGE)]
    reference = log_probs(args.model, "float32", texts)
    positions = sum(len(r) for r in reference)
    print("| int8 scales | top token equal to float32's | mean KL from float32 (nats) | perplexity, both passages |")
    print("|---|---|---|---|")
    for name, group in (("one per row", None), ("one per 64 of a row", 64), ("one per 32 of a row", 32)):
        ours = log_probs(args.model, group, texts)
        equal = sum((r.argmax(-1) == o.argmax(-1)).sum().item() for r, o in zip(reference, ours))
        kl = sum((r.exp() * (r - o)).sum().item() for r, o in zip(reference, ours)) / positions
        ppl = [math.exp(-o[:-1].gather(1, ids[1:, None]).mean().item()) for o, ids in zip(ours, texts)]
        print(f"| {name} | {equal} of {positions} | {kl:.5f} | " + " / ".join(f"{p:.3f}" for p in ppl) + " |")


if __name__ == "__main__":
    main()
