"""A library changes nothing of its process that the user did not ask for: importing nanoserve, building an
LLM and generating leave os.environ (which every child process inherits) and torch's process-wide settings
as they were. Run in a fresh process whose first import is nanoserve, as a user's program is."""
import json
import subprocess
import sys
from pathlib import Path

PROBE = """
import json, os
before = dict(os.environ)
import nanoserve
after_import = dict(os.environ)
import torch
def settings():
    return {"threads": torch.get_num_threads(), "grad": torch.is_grad_enabled(),
            "default_dtype": str(torch.get_default_dtype()), "matmul": torch.get_float32_matmul_precision(),
            "deterministic": torch.are_deterministic_algorithms_enabled(),
            "mkldnn": torch.backends.mkldnn.enabled}
torch_before = settings()
llm = nanoserve.LLM(nanoserve.DEFAULT_MODEL)
llm.generate(["It is a truth"], nanoserve.SamplingParams(max_tokens=4), use_tqdm=False)
print(json.dumps({"import": [k for k in before.keys() | after_import.keys() if before.get(k) != after_import.get(k)],
                  "llm": [k for k in before.keys() | os.environ.keys() if before.get(k) != os.environ.get(k)],
                  "torch_before": torch_before, "torch_after": settings()}))
"""


def test_import_and_llm_leave_the_environment_as_it_was() -> None:
    """Catches a variable set at import (OMP_WAIT_POLICY once was, and so slowed every child process's
    OpenMP, llama.cpp's in the benchmark too) or by LLM(), and a thread count or other torch setting
    changed behind the user's back."""
    result = subprocess.run([sys.executable, "-c", PROBE], cwd=Path(__file__).parents[1], capture_output=True,
                            text=True, check=True)
    changed = json.loads(result.stdout.strip().splitlines()[-1])
    assert changed["import"] == []
    assert changed["llm"] == []
    assert changed["torch_after"] == changed["torch_before"]
