"""The event loop's cost of one streamed tool call: a hermes call whose arguments hold --items objects, fed to a
ToolCallStream in deltas of --chars characters, as the server's stream does; prints the deltas, the total time
and the last delta's.

    PYTHONPATH=. python scripts/tool_stream_cost.py [--items 4900] [--chars 15]

docs/serving.md ("Tools") shows the figures.
"""
import argparse
import time

from nanoserve.entrypoints.openai.tool_parsers import HermesReader, ToolCallStream


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--items", type=int, default=4900)
    parser.add_argument("--chars", type=int, default=15)
    args = parser.parse_args()
    items = ", ".join(f'{{"k": "v{i}"}}' for i in range(args.items))
    text = f'<tool_call>{{"name": "f", "arguments": {{"items": [{items}]}}}}</tool_call>'
    deltas = [text[i:i + args.chars] for i in range(0, len(text), args.chars)]
    stream, last = ToolCallStream(HermesReader, None), 0.0
    start = time.perf_counter()
    for i, delta in enumerate(deltas):
        before = time.perf_counter()
        stream.feed(delta, final=i == len(deltas) - 1)
        last = time.perf_counter() - before
    print(f"{len(deltas)} deltas, {len(text)} characters: {time.perf_counter() - start:.3f} s in all, "
          f"{1e3 * last:.3f} ms for the last delta")


if __name__ == "__main__":
    main()
