"""The core runs alone: with every extension module unimportable, `LLM(DEFAULT_MODEL)` still imports, and
generates with prefix caching, chunked prefill and preemption the same tokens as the full engine and as
transformers. The extensions only plug into the core's seams (nanoserve/seams.py), through the composition root
(nanoserve/composition.py); test_architecture.py checks the imports, this test checks the running.

The core runs in a subprocess: `sys.modules[name] = None` there poisons nothing in this one."""
import json
import subprocess
import sys
from pathlib import Path

from test_engine import MAX_TOKENS, PROMPTS

import conftest
from conftest import greedy
from nanoserve import DEFAULT_MODEL, LLM

ROOT = Path(__file__).resolve().parent.parent
EXTENSIONS = ["nanoserve.extensions"] + sorted(
    f"nanoserve.extensions.{path.stem}" for path in (ROOT / "nanoserve" / "extensions").glob("*.py")
    if path.stem != "__init__")
# Small blocks, a small token budget and few blocks: prompts share prefixes, run in chunks, and are preempted
SETUP = dict(block_size=4, max_num_batched_tokens=8, num_kvcache_blocks=18, max_model_len=64)

CORE_ALONE = """
import json, sys
for name in {extensions!r}:
    sys.modules[name] = None  # `import name` now raises ImportError
from nanoserve import LLM, SamplingParams
from nanoserve.sampling_params import InvalidRequest
llm = LLM({model!r}, **{setup!r})
outputs = llm.generate({prompts!r}, [SamplingParams(temperature=0, max_tokens=n) for n in {max_tokens!r}],
                       use_tqdm=False)
try:  # what needs a missing extension is refused, by name
    llm.engine.add_request([5, 6], SamplingParams(repetition_penalty=1.2))
    refused = None
except InvalidRequest as error:
    refused = error.param
loaded = sorted(name for name in sys.modules if name.startswith("nanoserve.extensions") and sys.modules[name])
stats = llm.engine.stats()
print(json.dumps(dict(tokens=[o.token_ids for o in outputs], loaded=loaded, refused=refused,
                      preemptions=stats["num_preemptions"], cached=stats["num_cached_tokens"])))
"""


def test_the_core_generates_alone_as_the_full_engine_and_transformers():
    """Catches a core module that imports an extension (at import, or on the way to a step), a seam the core
    calls without checking it is filled, and a difference in tokens between the core and the full engine."""
    script = CORE_ALONE.format(extensions=EXTENSIONS, model=DEFAULT_MODEL, setup=SETUP, prompts=PROMPTS,
                               max_tokens=MAX_TOKENS)
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, cwd=ROOT, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    alone = json.loads(done.stdout.strip().splitlines()[-1])
    assert alone["loaded"] == [] and alone["refused"] == "sampling_params"
    assert alone["preemptions"] > 0 and alone["cached"] > 0  # preemption and prefix caching both happened
    full = LLM(DEFAULT_MODEL, **SETUP).generate(PROMPTS, [greedy(n) for n in MAX_TOKENS], use_tqdm=False)
    assert alone["tokens"] == [o.token_ids for o in full]
    assert alone["tokens"] == conftest.reference(DEFAULT_MODEL, PROMPTS, MAX_TOKENS)
