"""The `nanoserve` command (nanoserve/entrypoints/cli.py): its commands reach the server's, the
benchmarks' and the engine's code with their arguments, and a mistake is one line and exit status 2."""
import pytest

# Test extras (pyproject.toml's [test]) this module needs: without one it is skipped, not an error
pytest.importorskip("uvicorn")
pytest.importorskip("fastapi")
import importlib
import re
import shutil
import subprocess
import sys
from pathlib import Path

import nanoserve
import nanoserve.bench
from nanoserve import LLM, SamplingParams
from nanoserve.entrypoints import cli
from nanoserve.entrypoints.openai import api_server

ROOT = Path(__file__).resolve().parent.parent


def run_cli(argv: list[str], capsys) -> tuple[int, str, str]:
    """main(argv) in this process: (exit status, stdout, stderr)."""
    with pytest.raises(SystemExit) as exit_:
        cli.main(argv)
    out, err = capsys.readouterr()
    return exit_.value.code, out, err


# Catches: `nanoserve serve` not reaching the server's own options (or under another name), mistakes
# told in the usage text or a traceback instead of one line, the model loaded before a bad option is found.
def test_serve_help_and_mistakes(monkeypatch, capsys):
    monkeypatch.setattr(api_server, "LLMEngine", lambda config: pytest.fail("the model was loaded"))
    code, out, _ = run_cli(["serve", "--help"], capsys)
    assert code == 0 and out.startswith("usage: nanoserve serve") and "--max-num-queued-requests" in out
    assert "waiting and running" in " ".join(out.split())  # its help says it counts running requests too
    for argv, words in [(["serve", nanoserve.DEFAULT_MODEL, "--bogus"], "nanoserve serve: error: unrecognized"),
                        (["serve", nanoserve.DEFAULT_MODEL, "--block-size", "0"], "block_size"),
                        (["serve", nanoserve.DEFAULT_MODEL, "--quantization", "int3"], "quantization must be"),
                        (["serve", nanoserve.DEFAULT_MODEL, "--quantization", "int4", "--quantization-config",
                          '{"group_size": 48}'], "quantization_config must be"),
                        (["serve"], "model"),
                        (["bogus"], "invalid choice: 'bogus'"),
                        ([], "command")]:
        code, _, err = run_cli(argv, capsys)
        assert code == 2 and err.count("\n") == 1 and "error:" in err and words in err, (argv, err)


# Catches: the tool flags missing from `nanoserve serve --help`, --enable-auto-tool-choice accepted without a
# parser (every "auto" request would silently answer text), an unreadable --chat-template found only after loading.
def test_serve_tool_flags(monkeypatch, capsys, tmp_path):
    monkeypatch.setattr(api_server, "LLMEngine", lambda config: pytest.fail("the model was loaded"))
    _, out, _ = run_cli(["serve", "--help"], capsys)
    for flag in ("--chat-template", "--enable-auto-tool-choice", "--tool-call-parser"):
        assert flag in out
    for argv, words in [(["--enable-auto-tool-choice"], "needs --tool-call-parser"),
                        (["--tool-call-parser", "nope"], "invalid choice: 'nope'"),
                        (["--chat-template", str(tmp_path / "missing.jinja")], "cannot read")]:
        code, _, err = run_cli(["serve", nanoserve.DEFAULT_MODEL, *argv], capsys)
        assert code == 2 and words in err, (argv, err)
    assert api_server.read_chat_template("{{ messages }}") == "{{ messages }}"  # the template's text itself
    (tmp_path / "t.jinja").write_text("{% for m in messages %}{% endfor %}")
    assert api_server.read_chat_template(str(tmp_path / "t.jinja")) == "{% for m in messages %}{% endfor %}"


# Catches: pyproject's script entry naming a module or function that is not there, a command that
# fails outside pytest (no __main__ guard, an import that fails at start): the installed `nanoserve`
# runs if there is one, else the module it names.
def test_the_command_runs_in_its_own_process():
    # pyproject's `nanoserve = "module:function"` line (tomllib is not in Python 3.10)
    [entry] = re.findall(r'^nanoserve = "(.+)"', (ROOT / "pyproject.toml").read_text(), re.MULTILINE)
    module, function = entry.split(":")
    assert getattr(importlib.import_module(module), function) is cli.main
    command = [shutil.which("nanoserve")] if shutil.which("nanoserve") else [sys.executable, "-m", module]
    reply = subprocess.run([*command, "serve", nanoserve.DEFAULT_MODEL, "--port", "x"], cwd=ROOT,
                           capture_output=True, text=True, timeout=120)
    assert reply.returncode == 2 and reply.stderr.count("\n") == 1 and "--port" in reply.stderr, reply.stderr


# Catches: `nanoserve bench` dropping or reordering the benchmark's arguments.
def test_bench_gets_its_arguments(monkeypatch):
    calls = []
    monkeypatch.setattr(nanoserve.bench, "main", lambda argv, prog: calls.append((argv, prog)))
    cli.main(["bench", "--num-requests", "4", "--rates", "20,50"])
    assert calls == [(["--num-requests", "4", "--rates", "20,50"], "nanoserve bench")]


# Catches: generate printing a delta twice or not at all, a trailing text never printed, its sampling
# options (--temperature 0, --max-tokens) not reaching the engine: the text must be LLM.generate's.
def test_generate_prints_llm_generate_text(capsys):
    prompt = "It is a truth universally acknowledged"
    expected = LLM(nanoserve.DEFAULT_MODEL, device="cpu").generate(
        prompt, SamplingParams(temperature=0, max_tokens=24), use_tqdm=False)[0].text
    cli.main(["generate", nanoserve.DEFAULT_MODEL, prompt, "--temperature", "0", "--max-tokens", "24",
              "--device", "cpu"])
    assert capsys.readouterr().out == expected + "\n"
