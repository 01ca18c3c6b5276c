"""Smoke test: the benchmark runs end to end on a tiny model with a handful of requests.
Benchmarks are not tests: nothing here checks a speed."""
import json

from nanoserve.bench import main


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
