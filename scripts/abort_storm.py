"""Time an abort storm: 100,000 queued requests on the bundled model, then aborted in random order, as a
server aborts a large fan-out whose client left (its ids come out of a set). Prints the seconds per
1,000 aborts for this tree's scheduler and, with --before REF, for the scheduler at git REF, side by
side in one process (the engine, model and requests are the same; only the scheduler class differs).
Both are timed over the first 1,000 aborts, with the queue still full; this tree's over the whole storm too.

    python scripts/abort_storm.py --before e1e7428
"""
from __future__ import annotations

import argparse
import importlib.util
import math
import random
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))  # this tree's nanoserve, not an installed one

from nanoserve import DEFAULT_MODEL, LLM, SamplingParams  # noqa: E402
from nanoserve.scheduler import Scheduler  # noqa: E402


def scheduler_at(ref: str) -> type:
    """The Scheduler class of nanoserve/scheduler.py at git ref `ref`, imported beside this tree's."""
    source = subprocess.run(["git", "show", f"{ref}:nanoserve/scheduler.py"], check=True, capture_output=True,
                            text=True, cwd=ROOT).stdout
    path = Path(tempfile.mkdtemp()) / f"scheduler_{ref}.py"
    path.write_text(source)
    spec = importlib.util.spec_from_file_location(path.stem, path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module.Scheduler


def time_storm(llm: LLM, scheduler_class: type, num_queued: int, num_timed: int, whole: bool) -> tuple[float, float]:
    """Queue num_queued requests and abort them in random order. Returns the seconds per 1,000 aborts over
    the first num_timed (the queue still almost full) and, if `whole`, over all of them (else nan)."""
    engine = llm.engine
    old = engine.scheduler
    engine.scheduler = scheduler_class(old.config, len(old.block_manager.blocks), old.block_manager.block_size,
                                       old.max_model_len, old.eos_token_ids)
    params = SamplingParams(temperature=0, max_tokens=4)
    queued = [engine.add_request([1, 2, 3, 4], params) for _ in range(num_queued)]
    ids = random.Random(0).sample(queued, num_queued)
    start = time.perf_counter()
    for request_id in ids[:num_timed]:
        engine.abort_request(request_id)
    first = time.perf_counter() - start
    if not whole:
        engine.discard(queued)  # oldest first: each is at the front of the queue, found at once by any scheduler
        engine.step()
        return first / num_timed * 1000, math.nan
    for request_id in ids[num_timed:]:
        engine.abort_request(request_id)
    seconds = time.perf_counter() - start
    assert not engine.has_unfinished_requests() and len(engine.step().outputs) == num_queued
    return first / num_timed * 1000, seconds / num_queued * 1000


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--before", help="a git ref whose scheduler to time beside this tree's (first aborts only:"
                                         " a whole quadratic storm takes minutes)")
    parser.add_argument("--queued", type=int, default=100_000)
    parser.add_argument("--timed", type=int, default=1_000, help="aborts timed while the queue is still full")
    args = parser.parse_args()
    llm = LLM(DEFAULT_MODEL, num_kvcache_blocks=64)
    versions = ([(args.before, scheduler_at(args.before))] if args.before else []) + [("this tree", Scheduler)]
    print(f"{args.queued:,} queued requests aborted in random order: seconds per 1,000 aborts")
    for name, scheduler_class in versions:
        first, whole = time_storm(llm, scheduler_class, args.queued, args.timed, whole=scheduler_class is Scheduler)
        print(f"{name:>10}: the first {args.timed:,}: {first:.4f} s" + (f"   all {args.queued:,}: {whole:.4f} s"
                                                                        if not math.isnan(whole) else ""))


if __name__ == "__main__":
    main()
