"""Serve a few prompts of different lengths through nanoserve's continuous batching.

    python example.py                  # a tiny *random* Llama built on the spot (prints noise)
    python example.py --model PATH     # any local Llama checkpoint folder (config.json + safetensors)
"""
import argparse
import tempfile
import time

from nanoserve import LLM, SamplingParams

PROMPTS = ["Hello, my name is", "The capital of France is",
           "Once upon a time, in a small village at the edge of a great forest, there lived",
           "Continuous batching means"]


def build_random_llama(path: str) -> str:
    """A tiny Llama with random weights and no tokenizer: it shows the engine work, not language."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM
    torch.manual_seed(0)
    config = LlamaConfig(hidden_size=128, num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2,
                         intermediate_size=352, vocab_size=1000, max_position_embeddings=512)
    LlamaForCausalLM(config).save_pretrained(path)
    return path


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", help="a local Llama checkpoint folder (default: a tiny random Llama)")
    args = parser.parse_args()
    model = args.model or build_random_llama(tempfile.mkdtemp())
    llm = LLM(model, block_size=16)
    if llm.engine.tokenizer is None:
        print("Tiny RANDOM Llama without a tokenizer: prompts are token ids and completions are noise.\n")
        prompts = [[1] + [(7 * i + 3 * len(p)) % 1000 for i in range(len(p))] for p in PROMPTS]
    else:
        prompts = PROMPTS
    params = [SamplingParams(temperature=0, max_tokens=24), SamplingParams(temperature=0.8, top_p=0.95, seed=0, max_tokens=32),
              SamplingParams(temperature=0, max_tokens=16), SamplingParams(temperature=1.0, top_k=50, seed=1, max_tokens=40)]
    start = time.perf_counter()
    outputs = llm.generate(prompts, params)
    seconds = time.perf_counter() - start
    for out in outputs:
        shown = out.text if out.text is not None else out.token_ids
        print(f"[{out.request_id}] {out.prompt or out.prompt_token_ids!r}\n    -> {shown!r} "
              f"({len(out.token_ids)} tokens, {out.finish_reason}, TTFT {out.ttft * 1000:.0f} ms)")
    num_tokens = sum(len(o.token_ids) for o in outputs)
    print(f"\n{len(outputs)} requests, {num_tokens} tokens generated in {seconds:.2f} s")


if __name__ == "__main__":
    main()
