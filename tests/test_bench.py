"""Smoke test: the benchmark runs end to end on a tiny model with a handful of requests.
Benchmarks are not tests: nothing here checks a speed."""
import json

from nanoserve.bench import Machine, ModelShape, Step, main, step_limit


def test_benchmark_runs_every_engine(tiny_models, tmp_path, capsys):
    out = tmp_path / "bench.json"
    main(["--model", tiny_models["gqa"], "--num-requests", "4", "--input-len", "4-12", "--output-len", "2-6",
          "--kv-cache-tokens", "256", "--json", str(out)])
    results = json.loads(out.read_text())["results"]
    assert [r["engine"] for r in results] == ["nanoserve", "static", "hf-generate", "hf-cb"]
    assert all(r["output_tokens"] > 0 and r["seconds"] > 0 for r in results)
    assert "% of the roofline" in capsys.readouterr().out


def test_online_mode_runs(tiny_models, capsys):
    main(["--model", tiny_models["gqa"], "--num-requests", "3", "--input-len", "4-8", "--output-len", "2-4",
          "--kv-cache-tokens", "128", "--online", "--rates", "50"])
    table = capsys.readouterr().out
    assert "| continuous | 50 |" in table and "| static | 50 |" in table


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
    assert "| float32 | 3 |" in capsys.readouterr().out
