"""A server stopped with Ctrl-C (`python -m nanoserve.serve`, a subprocess on 127.0.0.1) exits 0 and quietly."""
import pytest

pytest.importorskip("httpx")
pytest.importorskip("xgrammar")
import re
import signal
import subprocess
import sys
import time

import httpx

import nanoserve


# Catches: the start-up objects left frozen (gc.freeze) at exit. Torch imports triton, a nanobind module,
# and nanobind found triton's types and functions alive at exit: ~600 "nanobind: leaked" lines on every
# stop. (Without triton installed this passes either way.) A grammar request loads xgrammar and its workers.
def test_a_stopped_server_prints_no_nanobind_leaks(tmp_path):
    log = tmp_path / "stderr.txt"
    with open(log, "w") as stderr:
        process = subprocess.Popen([sys.executable, "-m", "nanoserve.serve", nanoserve.DEFAULT_MODEL, "--host",
                                    "127.0.0.1", "--port", "0", "--device", "cpu", "--enforce-eager"], stderr=stderr)
    try:
        deadline = time.monotonic() + 300
        while not (found := re.search(r"serving .* at (http://\S+)", log.read_text())):
            assert process.poll() is None and time.monotonic() < deadline, log.read_text()
            time.sleep(0.2)
        body = dict(prompt="Emma", max_tokens=4, structured_outputs={"regex": "[a-z]{1,3}"})
        assert httpx.post(found[1] + "/v1/completions", json=body, timeout=300).status_code == 200
        process.send_signal(signal.SIGINT)
        assert process.wait(timeout=60) == 0, log.read_text()
    finally:
        process.kill()
    text = log.read_text()
    assert "Finished server process" in text
    assert "nanobind: leaked" not in text, text[-3000:]
