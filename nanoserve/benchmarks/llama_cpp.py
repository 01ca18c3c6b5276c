"""llama.cpp as a peer. Its own `llama-batched-bench` runs B sequences of a fixed prompt and a fixed
number of generated tokens (`run_llama_cpp`). nanoserve and transformers' `generate` run the same shape
(`run_nanoserve_batch`, `run_transformers_batch`). `peer_table` sets the three side by side per batch
size, in milliseconds per decode step and total tokens per second."""
from __future__ import annotations

import json
import shutil
import statistics
import subprocess
from dataclasses import dataclass

import torch

from nanoserve.benchmarks.throughput import run_hf_generate, run_nanoserve
from nanoserve.benchmarks.workload import make_workload, whole_blocks


@dataclass(frozen=True)
class PeerRow:
    """One engine at one batch size: B requests, each a fixed prompt and a fixed number of outputs."""
    engine: str
    batch_size: int
    ms_per_token: float   # one decode step, i.e. one output token of each request
    total_tok_s: float    # prompt + generated tokens over the wall time


def parse_batched_bench(output: str) -> list[PeerRow]:
    """Rows of `llama-batched-bench --output-format jsonl`. t_tg is the time of its tg decode steps
    after the prompts. speed is (B * pp + B * tg) / (t_pp + t_tg)."""
    rows = [json.loads(line) for line in output.splitlines() if line.startswith('{"n_kv_max"')]
    return [PeerRow("llama.cpp", r["pl"], 1000 * r["t_tg"] / r["tg"], r["speed"]) for r in rows]


def run_llama_cpp(binary: str, gguf: str, batch_sizes: list[int], prompt_len: int, gen_len: int,
                  threads: int) -> list[PeerRow]:
    """llama.cpp's own batched benchmark: B independent sequences (prompts not shared).
    Each has `prompt_len` random prompt tokens, then `gen_len` decode steps of all B together."""
    found = shutil.which(binary)
    if found is None:
        raise SystemExit(f"llama-batched-bench not found or not executable: {binary!r} (docs/performance.md's "
                         "'llama.cpp as a yardstick' shows how to build it)")
    context = max(batch_sizes) * (prompt_len + gen_len)  # it skips any B whose sequences do not fit
    cmd = [found, "-m", gguf, "-c", str(context), "-npp", str(prompt_len), "-ntg", str(gen_len),
           "-npl", ",".join(map(str, batch_sizes)), "-t", str(threads), "-tb", str(threads), "--output-format", "jsonl"]
    done = subprocess.run(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    rows = parse_batched_bench(done.stdout)
    if done.returncode != 0 or len(rows) != len(batch_sizes):
        raise SystemExit(f"{' '.join(cmd)} failed (exit {done.returncode}):\n{done.stdout[-2000:]}")
    return rows


def run_nanoserve_batch(path: str, batch_size: int, prompt_len: int, gen_len: int, dtype: str,
                        vocab_size: int, seed: int, enforce_eager: bool = True,
                        quantization: str | None = None) -> PeerRow:
    """The same shape on nanoserve: B requests of random prompt ids, greedy, EOS ignored, all at once.
    With `quantization` ("int8" or "int4"), its weights are so, to set beside a Q8_0 or a Q4_0 GGUF."""
    workload = make_workload(batch_size, (prompt_len, prompt_len), (gen_len, gen_len), vocab_size, seed)
    max_model_len = whole_blocks(prompt_len + gen_len, 16)
    result = run_nanoserve(path, workload, "continuous", block_size=16, max_num_seqs=batch_size, dtype=dtype,
                           max_model_len=max_model_len, num_kvcache_blocks=batch_size * max_model_len // 16 + 1,
                           enforce_eager=enforce_eager, quantization=quantization)
    decode = [s.seconds for s in result.steps if s.phase == "decode"]  # every request past its prompt
    return PeerRow("nanoserve", batch_size, 1000 * statistics.mean(decode), result.total_tok_s)


def run_transformers_batch(path: str, batch_size: int, prompt_len: int, gen_len: int, dtype: str,
                           vocab_size: int, seed: int) -> PeerRow:
    """The same shape on transformers' `generate` (run_hf_generate). It is one static batch with no padding,
    every prompt being prompt_len long. A decode step is the time between two generated tokens."""
    workload = make_workload(batch_size, (prompt_len, prompt_len), (gen_len, gen_len), vocab_size, seed)
    result = run_hf_generate(path, workload, dtype)
    return PeerRow("transformers", batch_size, 1000 * statistics.mean(result.tpot), result.total_tok_s)


def peer_table(rows: list[PeerRow]) -> str:
    """One line per batch size, with the engines side by side (in the order of `rows`). It ends with
    nanoserve's time per output token over llama.cpp's. "n/a" marks an engine with no row for that B."""
    engines = list(dict.fromkeys(r.engine for r in rows))
    by_key = {(r.engine, r.batch_size): r for r in rows}
    lines = ["| B | " + " | ".join(f"{e} ms/token" for e in engines) + " | "
             + " | ".join(f"{e} total tok/s" for e in engines) + " | nanoserve ÷ llama.cpp ms/token |",
             "|---" * (2 * len(engines) + 2) + "|"]
    for b in sorted({r.batch_size for r in rows}):
        cells = [by_key.get((e, b)) for e in engines]
        ours, theirs = by_key.get(("nanoserve", b)), by_key.get(("llama.cpp", b))
        ratio = f"{ours.ms_per_token / theirs.ms_per_token:.2f}x" if ours and theirs else "n/a"
        lines.append(f"| {b} | " + " | ".join(f"{r.ms_per_token:.1f}" if r else "n/a" for r in cells) + " | "
                     + " | ".join(f"{r.total_tok_s:.0f}" if r else "n/a" for r in cells) + f" | {ratio} |")
    return "\n".join(lines)


def compare_llama_cpp(binary: str, gguf: str, path: str, batch_sizes: list[int], prompt_len: int, gen_len: int,
                      dtype: str, vocab_size: int, seed: int, with_transformers: bool = True,
                      enforce_eager: bool = True, quantization: str | None = None) -> str:
    """llama.cpp, nanoserve and transformers at each batch size. llama.cpp runs in this process's environment
    as the user set it, with torch's thread count. (Its OpenMP reads OMP_* as torch's does.)"""
    rows = run_llama_cpp(binary, gguf, batch_sizes, prompt_len, gen_len, torch.get_num_threads())
    rows += [run_nanoserve_batch(path, b, prompt_len, gen_len, dtype, vocab_size, seed, enforce_eager, quantization)
             for b in batch_sizes]
    if with_transformers:
        rows += [run_transformers_batch(path, b, prompt_len, gen_len, dtype, vocab_size, seed) for b in batch_sizes]
    return peer_table(rows)

