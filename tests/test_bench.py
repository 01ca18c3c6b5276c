"""Smoke test: the benchmark runs end to end on a tiny model with a handful of requests.
Benchmarks are not tests: nothing here checks a speed."""
import pytest

# Test extras (pyproject.toml's [test]) this module needs: without one it is skipped, not an error
pytest.importorskip("httpx")
import json
import os
import subprocess
import sys
import time
from pathlib import Path

import httpx
import torch

import nanoserve
from conftest import build_tiny_llama
from nanoserve import LLMEngine
from nanoserve.bench import main
from nanoserve.benchmarks import llama_cpp, throughput
from nanoserve.benchmarks import main as cli
from nanoserve.benchmarks.http_client import stream_completion
from nanoserve.benchmarks.llama_cpp import PeerRow, parse_batched_bench, peer_table, run_transformers_batch
from nanoserve.benchmarks.online import OnlineRun, online_report
from nanoserve.benchmarks.roofline import Machine, ModelShape, describe_cpu, step_limit
from nanoserve.benchmarks.workload import Step, make_workload
from nanoserve.config import Config
from nanoserve.entrypoints.openai.api_server import ServerThread, build_app


def test_benchmark_runs_every_engine(tiny_models, tmp_path, capsys, monkeypatch):
    """--device reaches every engine and the roofline (the bug: transformers and the roofline on the
    CPU while nanoserve ran on the GPU)."""
    devices = []
    for module, name in ((throughput, "load_hf"), (cli, "measure_machine")):  # where each is looked up
        real = getattr(module, name)
        monkeypatch.setattr(module, name, lambda *args, real=real: devices.append(args[-1]) or real(*args))
    out = tmp_path / "bench.json"
    main(["--model", tiny_models["gqa"], "--num-requests", "4", "--input-len", "4-12", "--output-len", "2-6",
          "--kv-cache-tokens", "256", "--json", str(out), "--device", "cpu"])
    results = json.loads(out.read_text())["results"]
    assert [r["engine"] for r in results] == ["nanoserve", "static", "hf-generate", "hf-cb"]
    assert all(r["output_tokens"] > 0 and r["seconds"] > 0 for r in results)
    printed = capsys.readouterr().out
    assert "% of the roofline" in printed and "on cpu" in printed and devices == ["cpu", "cpu", "cpu"]
    # the CPU it ran on, as torch sees it: catches a table that cannot say which machine class it measured
    cpu = next(line for line in printed.splitlines() if line.startswith("CPU: "))
    assert f"torch capability {torch.backends.cpu.get_cpu_capability()};" in cpu
    assert f"{torch.get_num_threads()} threads" in cpu and ("no-avx2" in cpu) != torch.cpu._is_avx2_supported()


def test_online_mode_runs(tiny_models, capsys):
    main(["--model", tiny_models["gqa"], "--num-requests", "3", "--input-len", "4-8", "--output-len", "2-4",
          "--kv-cache-tokens", "128", "--online", "--rates", "50"])
    table = capsys.readouterr().out
    assert "| continuous | 50 |" in table and "| static | 50 |" in table


# Catches: SLOs compared in the wrong unit (seconds against milliseconds), a request counted good
# when it meets only one SLO, goodput divided by the wrong duration.
def test_goodput_counts_requests_that_meet_every_slo_per_second():
    run = OnlineRun("continuous", 4.0, ttft=[0.5, 1.5, 0.2, 0.9], tpot=[0.05, 0.05, 0.2, 0.1],
                    latency=[2.0, 3.0, 9.0, 6.0], seconds=4.0)
    assert run.goodput({"ttft": 1000, "tpot": 100}) == 2 / 4.0      # requests 0 and 3
    assert run.goodput({"ttft": 1000}) == 3 / 4.0
    assert run.goodput({"ttft": 1000, "tpot": 100, "e2el": 5000}) == 1 / 4.0


# Catches: the peak taken over both schedulers, or the ratio taken at continuous batching's own peak.
def test_online_report_finds_each_peak_and_compares_at_statics():
    def run(scheduling, rate, good):  # `good` of 4 requests meet ttft <= 1 s, over 2 seconds
        return OnlineRun(scheduling, rate, [0.1] * good + [5.0] * (4 - good), [0.01] * 4, [1.0] * 4, 2.0)
    runs = [run("continuous", 1, 2), run("continuous", 2, 3), run("continuous", 4, 4),
            run("static", 1, 2), run("static", 2, 1), run("static", 4, 0)]
    lines = online_report(runs, {"ttft": 1000}).splitlines()
    assert lines[0].startswith("| scheduling | rate (req/s) |") and "goodput (req/s; ttft <= 1000 ms)" in lines[0]
    assert lines[2] == "| continuous | 1 | 5.00 / 5.00 | 10.0 / 10.0 | 1.00 | 2.0 |"  # p50 of [0.1, 0.1, 5, 5]
    assert "continuous: goodput peaks at 2.00 req/s, offered 4 req/s" in lines
    assert "static: goodput peaks at 1.00 req/s, offered 1 req/s" in lines
    assert lines[-1] == "at 1 req/s, static batching's peak: continuous ÷ static goodput = 1.00x"


def test_online_mode_reports_goodput_and_refuses_a_bad_slo(tiny_models, capsys):
    main(["--model", tiny_models["gqa"], "--num-requests", "3", "--input-len", "4-8", "--output-len", "2-4",
          "--kv-cache-tokens", "128", "--online", "--rates", "50", "--goodput", "ttft:60000", "tpot:1000"])
    out = capsys.readouterr().out
    rows = [line.split(" | ") for line in out.splitlines() if line.startswith("| continuous | 50 |")]
    assert len(rows) == 1 and float(rows[0][4]) > 0  # a minute per first token: every request is good
    assert "continuous ÷ static goodput = " in out
    for bad in ("ttft=100", "itl:5", "tpot:-1", "tpot:fast"):
        with pytest.raises(SystemExit):
            main(["--model", tiny_models["gqa"], "--online", "--goodput", bad])
        assert "an SLO is ttft:MS" in capsys.readouterr().err


# Catches: prompt tokens counted as output in nano-vllm's table, or its lengths lost.
def test_nanovllm_workload_prints_nano_vllms_table(tiny_models, capsys):
    main(["--model", tiny_models["gqa"], "--workload", "nanovllm", "--num-requests", "6", "--kv-cache-tokens", "2048"])
    out = capsys.readouterr().out
    workload = make_workload(6, (13, 128), (13, 128), 256, 0)
    assert "6 requests" in out and "| Inference Engine | Output Tokens | Time (s) | Throughput (tokens/s) |" in out
    rows = [line.split(" | ") for line in out.splitlines() if line.startswith(("| nanoserve | ", "| static | "))][-2:]
    assert [row[1] for row in rows] == [f"{sum(r.output_len for r in workload):,}"] * 2


# Catches: transformers' continuous batching under --max-seconds (its requests stream) counting each streamed
# output rather than each request's newest one, or a capped run that ran to the end reported as cut short.
def test_hf_continuous_batching_with_a_time_cap_counts_each_request_once(tiny_models):
    workload = make_workload(4, (5, 12), (3, 9), 256, 0, temperature=0.6)
    capped = throughput.run_hf_continuous(tiny_models["gqa"], workload, "float32", max_seconds=600)
    assert capped.engine == "hf-cb" and "cut" not in capped.extra
    assert capped.output_tokens == sum(r.output_len for r in workload)
    assert len(capped.ttft) == len(workload)


# Catches: requests admitted in the same step not sharing the system prompt (the bug: each computed
# it), or cached tokens not counted.
def test_shared_prefix_workload_computes_the_system_prompt_once(tmp_path, capsys):
    path = build_tiny_llama(str(tmp_path / "model"), max_position_embeddings=512)
    main(["--model", path, "--workload", "shared-prefix", "--num-requests", "5"])
    out = capsys.readouterr().out
    workload = make_workload(5, (16, 64), (16, 64), 256, 0, shared_prefix=256)
    prompt_tokens = sum(len(r.prompt) for r in workload)
    rows = [line for line in out.splitlines() if line.startswith(("| on |", "| off |"))]
    on, off = ([int(x) for x in line.split(" | ")[1:3]] for line in rows)
    assert off == [prompt_tokens, 0]
    assert on == [prompt_tokens - 4 * 256, 4 * 256]  # one request computes it, the 4 others share it


def test_tensor_parallel_mode_compares_one_process_with_two_ranks(tiny_models, capsys):
    """Three rows, the middle one (1 process, 2x the threads) the baseline; catches a table that
    drops a setup, a ratio against the wrong row, or a thread count left changed afterwards."""
    threads = torch.get_num_threads()
    try:
        main(["--model", tiny_models["gqa"], "--num-requests", "2", "--input-len", "4-8", "--output-len", "3-5",
              "--kv-cache-tokens", "128", "--threads", "1", "--tensor-parallel", "2"])
        assert torch.get_num_threads() == 1  # --threads 1, restored after the 1 x 2 run
    finally:
        torch.set_num_threads(threads)
    rows = [line for line in capsys.readouterr().out.splitlines() if line.startswith("| ") and " x " in line[:8]]
    assert [row.split(" | ")[0] for row in rows] == ["| 1 x 1", "| 1 x 2", "| 2 x 1"]
    assert rows[1].endswith("| 1.00x |")


def test_bfloat16_run_reports_the_roofline_by_phase(tiny_models, capsys):
    main(["--model", tiny_models["gqa"], "--num-requests", "3", "--input-len", "4-12", "--output-len", "2-6",
          "--kv-cache-tokens", "256", "--dtype", "bfloat16", "--engines", "nanoserve,hf-generate"])
    out = capsys.readouterr().out
    assert "bfloat16" in out and "% of the roofline" in out
    assert "| prefill |" in out and "| decode |" in out


def test_step_limit_takes_the_larger_of_compute_and_memory():
    shape = ModelShape(layers=2, hidden=4, q_size=4, kv_size=2, intermediate=8, vocab=10, itemsize=4)
    per_layer = 4 * (4 + 2 * 2) + 4 * 4 + 3 * 4 * 8  # qkv, o, gate_up, down
    decode = Step(seconds=1.0, query_lens=[1, 1], seq_lens=[3, 5], num_sampled=2)
    flops = 2 * 2 * (per_layer * 2 + 2 * 4 * (3 + 5)) + 2 * 4 * 10 * 2
    bytes_ = 4 * (2 * per_layer + 4 * 10 + 2 * 2 * 2 * (3 + 5 + 2))
    assert step_limit(decode, shape, Machine(flops=1.0, bandwidth=1e9)) == (flops, True)
    assert step_limit(decode, shape, Machine(flops=1e9, bandwidth=1.0)) == (bytes_, False)
    # a prompt chunk of 3 queries over 10 keys: 10 + 9 + 8 query-key pairs
    chunk = Step(seconds=1.0, query_lens=[3], seq_lens=[10], num_sampled=0)
    assert step_limit(chunk, shape, Machine(flops=1.0, bandwidth=1e9))[0] == 2 * 2 * (per_layer * 3 + 2 * 4 * 27)
    assert (decode.phase, chunk.phase, Step(1.0, [1, 3], [4, 9], 1).phase) == ("decode", "prefill", "mixed")


def test_profile_decode_runs(tiny_models, capsys):
    main(["--model", tiny_models["gqa"], "--profile-decode", "3"])
    out = capsys.readouterr().out
    assert "| float32 | 3 |" in out and "| host, ms (share of the step) | schedule |" in out
    # the Python/ops split: a step of this 2-layer model calls tens of ops (each layer's norms, matmuls,
    # rotary, attention...), and the two shares are of the same step
    lines = out.splitlines()
    header = next(i for i, line in enumerate(lines) if line.startswith("| ops per step"))
    ops, in_ops, outside = lines[header + 2].split("|")[1:4]
    assert int(ops) > 2 * 10
    assert abs(int(in_ops.strip(" %")) + int(outside.strip(" %")) - 100) <= 1


def test_python_m_nanoserve_bench_still_runs():
    """The benchmarks moved into nanoserve/benchmarks/; catches nanoserve/bench.py losing its
    `python -m` entry point (docs/performance.md's commands use it)."""
    root = str(Path(__file__).resolve().parent.parent)  # this checkout's nanoserve, installed or not
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [root, os.environ.get("PYTHONPATH")]))}
    result = subprocess.run([sys.executable, "-m", "nanoserve.bench", "--help"], capture_output=True, text=True,
                            timeout=120, env=env)
    assert result.returncode == 0 and "--profile-decode N" in result.stdout and "--llama-cpp BINARY" in result.stdout


# Catches: server mode counting SSE chunks that carry no text (the role chunk, keep-alives, the
# usage chunk, [DONE]) as tokens, or losing a request: every requested token must come back.
def test_server_mode_loads_a_running_server(capsys):
    engine = LLMEngine(Config.from_kwargs(nanoserve.DEFAULT_MODEL, device="cpu", block_size=8, num_kvcache_blocks=33))
    server = ServerThread(build_app(engine, "tiny", api_key="sk-test")).start()
    workload = make_workload(4, (4, 8), (2, 4), 1000, 0)  # what main sends
    try:
        main(["--server", server.url, "--api-key", "sk-test", "--num-requests", "4", "--input-len", "4-8",
              "--output-len", "2-4", "--rates", "20,50"])
        with httpx.Client(base_url=server.url, headers={"Authorization": "Bearer sk-test"}) as client:
            streams = [stream_completion(client, "tiny", r, time.perf_counter()) for r in workload]
    finally:
        server.stop()
    rows = [line.split("|")[1:-1] for line in capsys.readouterr().out.splitlines() if line.startswith("| ")]
    assert [row[0].strip() for row in rows[1:]] == ["20", "50"]  # one row per rate after the header
    assert all("nan" not in row[1] + row[2] and float(row[3]) > 0 for row in rows[1:])
    assert [s.output_tokens for s in streams] == [r.output_len for r in workload]
    assert all(s.ttft is not None and 0 < s.ttft < 10 and len(s.itl) <= r.output_len - 1
               for s, r in zip(streams, workload))


# Catches: reading llama.cpp's total time as the decode time, or per-token latency as a rate.
# A canned line of `llama-batched-bench --output-format jsonl`; llama.cpp itself never runs here.
def test_llama_cpp_output_is_parsed_per_batch_size(capsys):
    output = ("main: n_kv_max = 2048, n_batch = 2048\n"
              '{"n_kv_max": 2048, "n_batch": 2048, "n_ubatch": 512, "flash_attn": 0, "is_pp_shared": 0, '
              '"n_gpu_layers": 99, "n_threads": 8, "n_threads_batch": 8, "pp": 128, "tg": 128, "pl": 8, "n_kv": 2048, '
              '"t_pp": 0.5, "speed_pp": 2048.0, "t_tg": 2.56, "speed_tg": 400.0, "t": 3.06, "speed": 669.28}\n')
    assert parse_batched_bench(output) == [PeerRow("llama.cpp", 8, 20.0, 669.28)]
    try:
        main(["--model", nanoserve.DEFAULT_MODEL, "--llama-cpp", "/nonexistent/llama-batched-bench",
              "--gguf", "x.gguf"])
    except SystemExit as error:
        assert "not found" in str(error)
    else:
        raise AssertionError("a missing binary must stop the run")


# Catches: --quantization not reaching nanoserve beside a Q8_0 or Q4_0 GGUF (its row silently float), or int4
# refused by the bench's own choices; llama.cpp is canned.
@pytest.mark.parametrize("quantization, gguf", [("int8", "q8_0.gguf"), ("int4", "q4_0.gguf")])
def test_llama_cpp_comparison_passes_quantization(tiny_models, monkeypatch, capsys, quantization, gguf):
    configs = []

    def spy(path, workload, scheduling, **config):
        configs.append(config)
        return throughput.run_nanoserve(path, workload, scheduling, **config)
    monkeypatch.setattr(llama_cpp, "run_llama_cpp", lambda *args: [PeerRow("llama.cpp", 1, 20.0, 100.0)])
    monkeypatch.setattr(llama_cpp, "run_nanoserve", spy)
    main(["--model", tiny_models["gqa"], "--llama-cpp", "llama-batched-bench", "--gguf", f"/models/{gguf}",
          "--batch-sizes", "1", "--prompt-len", "4", "--gen-len", "3", "--quantization", quantization,
          "--no-transformers"])
    assert [c["quantization"] for c in configs] == [quantization]
    assert f"llama.cpp runs {gguf}, nanoserve quantization={quantization}" in capsys.readouterr().out


# Catches: a batch size llama.cpp skipped (its sequences did not fit its context) shifting the other
# engines' numbers into its column, and the nanoserve / llama.cpp ratio taken upside down.
def test_peer_table_puts_each_engine_in_its_own_column(tiny_models):
    rows = [PeerRow("llama.cpp", 1, 20.0, 100.0), PeerRow("nanoserve", 1, 30.0, 60.0),
            PeerRow("nanoserve", 64, 200.0, 500.0),
            run_transformers_batch(tiny_models["gqa"], 2, 4, 3, "float32", 256, 0)]
    lines = peer_table(rows).splitlines()
    assert lines[0] == ("| B | llama.cpp ms/token | nanoserve ms/token | transformers ms/token | "
                        "llama.cpp total tok/s | nanoserve total tok/s | transformers total tok/s | "
                        "nanoserve ÷ llama.cpp ms/token |")
    assert lines[2] == "| 1 | 20.0 | 30.0 | n/a | 100 | 60 | n/a | 1.50x |"
    assert lines[3].startswith("| 2 | n/a | n/a | ") and lines[3].endswith(" | n/a |")  # transformers only
    assert lines[4] == "| 64 | n/a | 200.0 | n/a | n/a | 500 | n/a | n/a |"
    assert rows[-1].ms_per_token > 0 and rows[-1].total_tok_s > 0


def test_the_cpu_line_names_the_openmp_settings_every_engine_shares(monkeypatch):
    """llama.cpp and torch both read OMP_* from the environment: a table must say which were set. Catches a
    line that hides a wait policy, which once halved llama.cpp's speed in this benchmark."""
    for name in ("OMP_NUM_THREADS", "OMP_WAIT_POLICY", "GOMP_SPINCOUNT", "KMP_BLOCKTIME"):
        monkeypatch.delenv(name, raising=False)
    assert "OpenMP as its defaults" in describe_cpu()
    monkeypatch.setenv("OMP_WAIT_POLICY", "PASSIVE")
    assert "OpenMP OMP_WAIT_POLICY=PASSIVE" in describe_cpu()
