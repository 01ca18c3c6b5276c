"""AsyncLLM (nanoserve/entrypoints/async_llm.py) from plain asyncio, no HTTP, on the bundled model: what it
streams equals LLM.generate offline, requests run together, and an abort frees the KV cache."""
import asyncio
import contextlib
import time

import pytest

import nanoserve
from nanoserve import LLM, LLMEngine, RequestDelta, RequestOutput, SamplingParams
from nanoserve.config import Config
from nanoserve.entrypoints.async_llm import AsyncLLM, EngineGenerateError, ReplyQueue, StatLogger, Submit
from nanoserve.entrypoints.fair_queue import FairQueue

ENGINE = dict(device="cpu", block_size=8, num_kvcache_blocks=25, max_model_len=128)
PROMPTS = ["It is a truth universally acknowledged", "Mr. Darcy looked at her, and"]
LONG = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True)


@pytest.fixture(scope="module")
def offline():
    return LLM(nanoserve.DEFAULT_MODEL, **ENGINE)


def new_engine() -> LLMEngine:
    return LLMEngine(Config.from_kwargs(nanoserve.DEFAULT_MODEL, **ENGINE))


async def collect(llm: AsyncLLM, prompt_token_ids: list[int], params: SamplingParams, request_id: str,
                  order: list[tuple[str, str]]) -> tuple[list[RequestDelta], RequestOutput]:
    """A request's deltas and its output, each noted in `order` as ("delta" | "output", request_id)."""
    deltas, outputs = [], []
    async for result in llm.generate(prompt_token_ids, params, request_id):
        is_delta = isinstance(result, RequestDelta)
        (deltas if is_delta else outputs).append(result)
        order.append(("delta" if is_delta else "output", result.request_id))
    assert len(outputs) == 1, "a stream ends with exactly one RequestOutput"
    return deltas, outputs[0]


def test_greedy_stream_equals_llm_generate(offline):
    """Catches: deltas lost or sent twice (their text and tokens would not add up to the output's),
    the sampling params not reaching the engine, another request's results in this stream."""
    expected = offline.generate(PROMPTS[0], LONG, use_tqdm=False)[0]

    async def run():
        async with AsyncLLM(new_engine()) as llm:
            return await collect(llm, expected.prompt_token_ids, LONG, "greedy", [])
    deltas, output = asyncio.run(run())
    assert output.token_ids == expected.token_ids and output.text == expected.text
    assert [t for d in deltas for t in d.token_ids] == expected.token_ids
    assert "".join(d.text for d in deltas) == expected.text
    assert deltas[-1].finish_reason == output.finish_reason == "length"


def test_two_generates_interleave_and_both_finish(offline):
    """Catches: requests served one after the other instead of batched together (the second's first
    token would come after the first's output), replies crossed between two streams, one stream
    left waiting after the other finished."""
    expected = offline.generate(PROMPTS, LONG, use_tqdm=False)
    order: list[tuple[str, str]] = []

    async def run():
        async with AsyncLLM(new_engine()) as llm:
            return await asyncio.gather(*(collect(llm, e.prompt_token_ids, LONG, f"r{i}", order)
                                          for i, e in enumerate(expected)))
    results = asyncio.run(run())
    for (deltas, output), e, request_id in zip(results, expected, ["r0", "r1"]):
        assert output.text == e.text and output.request_id == request_id
        assert {d.request_id for d in deltas} == {request_id}
    for a, b in (("r0", "r1"), ("r1", "r0")):  # each one's first token came before the other's output
        assert order.index(("delta", a)) < order.index(("output", b)), order


class EngineLog(StatLogger):
    """What the engine thread reports: the requests finished, and the free blocks after its last step."""

    def __init__(self) -> None:
        self.finished: list[RequestOutput] = []
        self.num_free_blocks: int | None = None

    def record_finished(self, output: RequestOutput) -> None:
        self.finished.append(output)

    def record_engine(self, stats: dict[str, int]) -> None:
        self.num_free_blocks = stats["num_free_blocks"]


def test_abort_mid_stream_frees_every_block():
    """Catches: an abort that never reaches the engine (the request runs on to max_tokens), KV blocks
    not freed, a stream that hangs after abort() instead of ending with its aborted output, a reader
    that stops early (closing its stream) leaving its request running."""
    engine, log = new_engine(), EngineLog()
    free_at_start = engine.stats()["num_free_blocks"]
    params = SamplingParams(temperature=0, max_tokens=100, ignore_eos=True)
    prompt = engine.tokenizer.encode(PROMPTS[1])

    async def abort_after_three_deltas(llm: AsyncLLM) -> RequestOutput:
        num_deltas = 0
        async for result in llm.generate(prompt, params, "aborted"):
            if isinstance(result, RequestOutput):
                return result
            num_deltas += 1
            if num_deltas == 3:
                assert log.num_free_blocks < free_at_start  # blocks held while it runs (the engine thread's count)
                llm.abort("aborted")
        raise AssertionError("the stream ended without its output")

    async def leave_after_one_delta(llm: AsyncLLM) -> None:
        async with contextlib.aclosing(llm.generate(prompt, params, "left")) as stream:
            async for _ in stream:
                break
        while not any(o.request_id == "left" for o in log.finished):  # the abort reaches the engine thread
            await asyncio.sleep(0.01)

    async def run():
        async with AsyncLLM(engine, log) as llm:
            output = await asyncio.wait_for(abort_after_three_deltas(llm), timeout=30)
            await asyncio.wait_for(leave_after_one_delta(llm), timeout=30)
            return output
    output = asyncio.run(run())
    assert output.finish_reason == "abort" and 3 <= len(output.token_ids) < 100
    assert [(o.request_id, o.finish_reason) for o in log.finished] == [("aborted", "abort"), ("left", "abort")]
    assert len(log.finished[1].token_ids) < 100
    assert engine.stats()["num_free_blocks"] == free_at_start and not engine.requests  # the thread has stopped


def test_a_failed_step_aborts_its_requests_in_the_engine():
    """Catches: an engine loop that, after a failed step, fails its requests' streams but forgets to
    abort them in the engine: they run on (tokens nobody reads, KV blocks held) after their clients
    got an error."""
    engine = new_engine()
    free_at_start = engine.stats()["num_free_blocks"]
    step, num_steps = engine.step, []

    def fail_on_the_third_step():  # by then the request runs and holds blocks
        num_steps.append(1)
        if len(num_steps) == 3:
            raise RuntimeError("a device failure")
        if len(num_steps) > 3:  # only a forgotten request steps on: slowly, so it is still there at shutdown
            time.sleep(0.05)
        return step()
    engine.step = fail_on_the_third_step
    prompt = engine.tokenizer.encode(PROMPTS[0])

    async def run() -> None:
        async with AsyncLLM(engine) as llm:
            stream = llm.stream()  # never closed: its abort on close would hide a loop that forgot its requests
            await stream.submit([("failed", prompt, SamplingParams(max_tokens=100, ignore_eos=True))])
            with pytest.raises(EngineGenerateError, match="a device failure"):
                async for _ in stream:
                    pass
    asyncio.run(run())  # the loop has stopped: what it left in the engine stays there
    assert not engine.requests
    assert engine.stats()["num_free_blocks"] == free_at_start


class Order(StatLogger):
    """The engine thread's order of events: ("token", request_id) per delta, ("finished", request_id)."""

    def __init__(self) -> None:
        self.events: list[tuple[str, str]] = []

    def record_step(self, result, start: float, end: float) -> None:
        self.events.extend(("token", delta.request_id) for delta in result.deltas)

    def record_finished(self, output: RequestOutput) -> None:
        self.events.append(("finished", output.request_id))


def test_a_fan_out_does_not_starve_the_next_streams_first_token():
    """Catches: first-come-first-served admission across completions, where one stream's 48 queued
    requests (an HTTP request's prompts x n) all run before another stream's single request gets a
    token; and an abort of requests still queued that never ends their streams."""
    engine = LLMEngine(Config.from_kwargs(nanoserve.DEFAULT_MODEL, **{**ENGINE, "max_num_seqs": 4}))
    order, prompt = Order(), engine.tokenizer.encode(PROMPTS[0])
    params = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)

    async def run() -> None:
        async with AsyncLLM(engine, order) as llm:
            fan_out = llm.stream()
            submitted = asyncio.ensure_future(fan_out.submit([(f"fan-{i}", prompt, params) for i in range(48)]))
            await asyncio.sleep(0)  # its 48 Submits are in the inbox before the bystander's
            async for _ in llm.generate(prompt, params, "bystander"):
                pass
            fan_out.close()  # aborts the fan-out's requests still queued (never handed to the engine) too
            await submitted  # settled by their aborted outputs
    asyncio.run(run())
    first_token = order.events.index(("token", "bystander"))
    num_fan_out_finished = sum(1 for kind, request_id in order.events[:first_token] if kind == "finished")
    assert num_fan_out_finished <= 4 + 1  # a batch of the fan-out, then one more turn; not 44 of them
    finished = [request_id for kind, request_id in order.events if kind == "finished"]
    assert sorted(finished) == sorted([f"fan-{i}" for i in range(48)] + ["bystander"])  # every one, once
    assert not engine.requests and engine.stats()["num_free_blocks"] == 24


def test_fair_queue_takes_turns_across_streams_and_removes_any_request():
    """Catches: a pending queue that serves a stream's requests all before the next stream's, or loses
    or repeats a request when one is removed from the middle."""
    async def run() -> list[str]:
        a, b = ReplyQueue(), ReplyQueue()
        pending = FairQueue()
        for request_id in ("a0", "a1", "a2", "a3"):
            pending.add(Submit(request_id, [1], SamplingParams(), 0.0, a))
        for request_id in ("b0", "b1"):
            pending.add(Submit(request_id, [1], SamplingParams(), 0.0, b))
        assert pending.remove("a1").request_id == "a1" and "a1" not in pending
        taken = [pending.pop_next().request_id for _ in range(len(pending))]
        assert len(pending) == 0 and not pending.streams
        return taken
    assert asyncio.run(run()) == ["a0", "b0", "a2", "b1", "a3"]


def test_metrics_count_every_finish_once_whoever_made_it_and_forget_its_id():
    """A request the engine aborted itself, one that failed alone (its grammar), one the loop aborted, one that
    ran to its end: each counted once by its finish reason, and no id left in Metrics' per-request maps.
    Catches: the engine loop skipping every "abort" output (it assumed the loop had made them all): the engine's
    own aborts never counted, their ids kept for good; a failed request answered with its output."""
    from nanoserve.entrypoints.openai.metrics import Metrics
    from nanoserve.extensions.structured_outputs import StructuredOutputsParams
    engine = new_engine()
    metrics = Metrics("m", engine.model_runner.num_blocks - 1)
    prompt = engine.tokenizer.encode(PROMPTS[0])
    step, num_steps = engine.step, iter(range(10**6))

    def step_aborting_victim():  # the engine's own abort, as a policy of its own would make it
        if next(num_steps) == 3 and "victim" in engine.requests:
            engine.abort_request("victim")
        return step()
    engine.step = step_aborting_victim
    dead_end = StructuredOutputsParams(grammar='root ::= "a" x\nx ::= x')

    async def drain(llm: AsyncLLM, request_id: str, params: SamplingParams, abort_after: int | None = None) -> object:
        """Its finish reason, or the ValueError it raised; aborted by the loop after `abort_after` deltas."""
        try:
            async for result in llm.generate(prompt, params, request_id):
                if isinstance(result, RequestOutput):
                    return result.finish_reason
                if abort_after is not None:
                    abort_after -= 1
                    if abort_after == 0:
                        llm.abort(request_id)
        except ValueError as error:
            return error

    async def run():
        async with AsyncLLM(engine, metrics) as llm:
            return await asyncio.wait_for(asyncio.gather(
                drain(llm, "victim", LONG),
                drain(llm, "failing", SamplingParams(max_tokens=8, structured_outputs=dead_end)),
                drain(llm, "aborted", LONG, abort_after=2),
                drain(llm, "done", SamplingParams(temperature=0, max_tokens=4))), timeout=60)
    victim, failing, aborted, done = asyncio.run(run())
    assert (victim, aborted, done) == ("abort", "abort", "length")
    assert isinstance(failing, ValueError) and "allows no token" in str(failing)
    counts = {reason: metrics.success.labels("m", reason)._value.get() for reason in ("abort", "error", "length")}
    assert counts == {"abort": 2, "error": 1, "length": 1}
    assert not metrics.unscheduled and not metrics.no_token_yet and not metrics.last_token_time


def test_turns_are_per_client_and_one_client_holds_at_most_its_share_of_the_engine():
    """Catches: turns per stream (a client with many streams, here 10, puts all of them before another
    client's first request), and no bound on one client's engine slots (it takes all max_num_seqs, so another
    client's first token waits for one of its requests to end)."""
    from nanoserve.entrypoints.async_llm import EngineLoop
    engine = LLMEngine(Config.from_kwargs(nanoserve.DEFAULT_MODEL, **{**ENGINE, "max_num_seqs": 8}))
    loop = EngineLoop(engine, StatLogger())
    prompt = engine.tokenizer.encode(PROMPTS[0])

    async def reply_queues():
        return [ReplyQueue() for _ in range(12)]
    queues = asyncio.run(reply_queues())
    for stream in range(10):  # client A: 10 streams of 2
        for i in range(2):
            loop.pending.add(Submit(f"a{stream}-{i}", prompt, LONG, 0.0, queues[stream], client="A"))
    loop.admit()
    assert len(engine.requests) == 7  # 8 - 8 // 8: one slot left for the others
    loop.pending.add(Submit("b", prompt, LONG, 0.0, queues[10], client="B"))
    loop.pending.add(Submit("c", prompt, LONG, 0.0, queues[11]))  # no client: its stream's own turn
    loop.admit()
    assert "b" in engine.requests and sum(r.startswith("a") for r in engine.requests) == 7
    engine.discard(list(engine.requests))
    loop.num_in_engine.clear()
    loop.client_of.clear()
    loop.admit()  # A up to its share, then c
    assert sorted(engine.requests) == ["a3-1", "a4-0", "a4-1", "a5-0", "a5-1", "a6-0", "a6-1", "c"]
