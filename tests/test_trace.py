"""The walkthrough (docs/walkthrough.md) replayed on a real engine (a tiny random Llama), and the
step traces that show it."""
import pytest

# Test extras (pyproject.toml's [test]) this module needs: without one it is skipped, not an error
pytest.importorskip("matplotlib")
import sys
from pathlib import Path

import matplotlib

from conftest import build_tiny_llama
from nanoserve import LLM, SamplingParams
from nanoserve.entrypoints.trace import format_step

matplotlib.use("Agg")  # headless: no display needed
import matplotlib.pyplot as plt  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "notebooks"))  # the notebooks' drawing module
from block_map import plot_block_map  # noqa: E402

WALKTHROUGH_PROMPTS = [[1, 2, 3, 4, 5], [1, 6, 5, 7, 8, 9, 10], [1, 12, 13]]


@pytest.fixture(scope="module")
def tiny_llama(tmp_path_factory) -> str:
    return build_tiny_llama(str(tmp_path_factory.mktemp("trace") / "tiny"))


def walkthrough_engine(path: str, max_tokens: list[int], **config):
    """An engine with the walkthrough's three prompts queued, as requests "0", "1", "2"."""
    engine = LLM(path, block_size=4, **config).engine
    for prompt, n in zip(WALKTHROUGH_PROMPTS, max_tokens):
        engine.add_request(prompt, SamplingParams(temperature=0, max_tokens=n, ignore_eos=True))
    return engine


def test_engine_replays_the_walkthrough_numbers(tiny_llama):
    engine = walkthrough_engine(tiny_llama, [4, 4, 4])
    step1 = engine.step()
    batch = step1.batch
    assert batch.input_ids.tolist() == [1, 2, 3, 4, 5, 1, 6, 5, 7, 8, 9, 10, 1, 12, 13]
    assert batch.positions.tolist() == [0, 1, 2, 3, 4, 0, 1, 2, 3, 4, 5, 6, 0, 1, 2]
    assert batch.slot_mapping.tolist() == [4, 5, 6, 7, 8, 12, 13, 14, 15, 16, 17, 18, 20, 21, 22]
    assert batch.query_start_loc.tolist() == [0, 5, 12, 15]
    assert batch.seq_lens.tolist() == [5, 7, 3]
    assert [engine.requests[r].block_table for r in "012"] == [[1, 2], [3, 4], [5]]
    assert (step1.num_prefill_tokens, step1.num_decode_tokens) == (15, 0)
    sampled = [engine.requests[r].token_ids[-1] for r in "012"]  # the walkthrough's [14, 15, 16]
    step2 = engine.step()
    assert step2.batch.input_ids.tolist() == sampled
    assert step2.batch.positions.tolist() == [5, 7, 3]
    assert step2.batch.slot_mapping.tolist() == [9, 19, 23]
    assert step2.batch.seq_lens.tolist() == [6, 8, 4]
    assert (step2.num_prefill_tokens, step2.num_decode_tokens) == (0, 3)


def test_format_step_prints_the_walkthrough_lines(tiny_llama):
    engine = walkthrough_engine(tiny_llama, [4, 4, 1])
    text = format_step(engine.step(), 1)
    lines = text.splitlines()
    assert lines[0] == "step 1: 3 requests, 15 tokens (15 prefill, 0 decode)"
    for line in ["input_ids       = [1, 2, 3, 4, 5, 1, 6, 5, 7, 8, 9, 10, 1, 12, 13]",
                 "positions       = [0, 1, 2, 3, 4, 0, 1, 2, 3, 4, 5, 6, 0, 1, 2]",
                 "slot_mapping    = [4, 5, 6, 7, 8, 12, 13, 14, 15, 16, 17, 18, 20, 21, 22]",
                 "query_start_loc = [0, 5, 12, 15]",
                 "seq_lens        = [5, 7, 3]",
                 "block_tables    = [[1, 2], [3, 4], [5]]",  # the null-block padding is dropped
                 "prefill         : 0 (5 tokens from position 0), 1 (7 tokens from position 0), "
                 "2 (3 tokens from position 0)",
                 "decode          : -",
                 "finished        : 2 (length, 1 tokens out)"]:
        assert line in lines
    text = format_step(engine.step(), 2)
    assert "decode          : 0 at position 5, 1 at position 7" in text
    assert "prefill         : -" in text


def test_format_step_tells_a_prefix_hit_from_a_decode(tiny_llama):
    # The second request's prompt is all cached but its last token: one token at position 8
    # that is still a prefill, though it looks like a decode in the batch.
    engine = LLM(tiny_llama, block_size=4).engine
    prompt = list(range(20, 29))
    engine.add_request(prompt, SamplingParams(temperature=0, max_tokens=1), request_id="first")
    engine.step()
    engine.add_request(prompt, SamplingParams(temperature=0, max_tokens=1), request_id="again")
    result = engine.step()
    assert result.scheduled == [("again", 1)] and result.decode_ids == []
    assert "prefill         : again (1 tokens from position 8)" in format_step(result)


def test_format_step_of_an_idle_step(tiny_llama):
    engine = LLM(tiny_llama, block_size=4).engine
    assert format_step(engine.step(), 7) == "step 7: nothing scheduled"


def test_plot_block_map_draws_every_slot_of_every_block(tiny_llama):
    engine = walkthrough_engine(tiny_llama, [2, 4, 4], num_kvcache_blocks=8, max_model_len=16)
    engine.step(), engine.step()  # request 0 finishes: blocks 2 and 1 go back, 1 stays cached
    manager = engine.scheduler.block_manager
    ax = plot_block_map(manager, engine)
    assert len(ax.patches) == 8 * 4
    assert [t.get_text() for t in ax.get_yticklabels()] == [f"block {b}" for b in range(8)]
    labels = [t.get_text() for t in ax.texts if t.get_text().startswith(("ref_cnt", "null"))]  # no block shared
    assert labels == ["null"] + [f"ref_cnt {manager.blocks[b].ref_cnt}" for b in range(1, 8)]
    legend = [t.get_text() for t in ax.get_legend().get_texts()]
    assert legend == ["request 1", "request 2", "free", "free, cached", "null block"]
    ax.figure.canvas.draw()  # renders headless
    plt.close(ax.figure)
