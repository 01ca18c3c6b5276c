"""The KV cache drawn as in the walkthrough's pictures, for the notebooks (matplotlib).

`plot_block_map(block_manager, requests)`: one row per block, one cell per slot, coloured by the
request whose block table holds it. It only reads: it never changes the engine or the block manager.
The notebooks import it from here (their working folder); it is not part of the engine.
"""
from __future__ import annotations

from collections.abc import Iterable

import matplotlib.pyplot as plt
from matplotlib.axes import Axes
from matplotlib.patches import Patch, Rectangle

from nanoserve.block_manager import BlockManager
from nanoserve.engine import LLMEngine
from nanoserve.sequence import Sequence


def plot_block_map(block_manager: BlockManager, requests: Iterable[Sequence] | LLMEngine,
                   ax: Axes | None = None) -> Axes:
    """Draw the KV cache: a row per block, a cell per slot, each cell labelled with its token id.

    A slot is solid in its request's colour once its KV is computed, pale while only reserved.
    Block 0 is the null block (dark); a free block is white, or grey with its tokens when it is free
    but still cached (a prefix-cache hit can revive it). ref_cnt is written right of each row, in
    bold for a block shared by several requests (drawn in the colour of the first that holds it).
    Returns the matplotlib Axes; `requests` is the live sequences, or an engine to take them from.
    """
    seqs = list(requests.requests.values() if isinstance(requests, LLMEngine) else requests)
    size, num_blocks = block_manager.block_size, len(block_manager.blocks)
    if ax is None:
        _, ax = plt.subplots(figsize=(1.5 + 0.45 * (size + 3), 0.8 + 0.3 * num_blocks))
    colours = {seq.request_id: request_colour(seq.request_id) for seq in seqs if seq.block_table}
    cells: dict[tuple[int, int], tuple] = {}  # (block, slot) -> (colour, alpha, token id)
    for seq in seqs:
        for i, block_id in enumerate(seq.block_table):
            for slot in range(size):
                t = i * size + slot
                token = seq.token_ids[t] if t < seq.num_tokens else ""
                alpha = 1.0 if t < seq.num_computed_tokens else 0.3
                cells.setdefault((block_id, slot), (colours[seq.request_id], alpha, token))
    for block in block_manager.blocks:
        free_cached = block.ref_cnt == 0 and block.hash is not None
        for slot in range(size):
            colour, alpha, token = cells.get((block.block_id, slot), ("white", 1.0, ""))
            if block.block_id == 0:
                colour = "dimgray"
            elif free_cached:
                colour, token = "lightgray", block.token_ids[slot]
            ax.add_patch(Rectangle((slot, block.block_id), 1, 1, facecolor=colour, alpha=alpha, edgecolor="black"))
            ax.text(slot + 0.5, block.block_id + 0.5, str(token), ha="center", va="center", fontsize=8)
        shared = ", shared" if block.ref_cnt > 1 else ""
        label = "null" if block.block_id == 0 else f"ref_cnt {block.ref_cnt}{shared}"
        ax.text(size + 0.15, block.block_id + 0.5, label, va="center", fontsize=8,
                fontweight="bold" if block.ref_cnt > 1 else "normal")
    ax.set_xlim(0, size + 3)  # room for the ref_cnt labels
    ax.set_ylim(num_blocks, 0)  # block 0 on top
    ax.set_xticks([s + 0.5 for s in range(size)], [str(s) for s in range(size)])
    ax.set_yticks([b + 0.5 for b in range(num_blocks)], [f"block {b}" for b in range(num_blocks)])
    ax.set_xlabel("slot in block")
    ax.tick_params(length=0)
    ax.spines[:].set_visible(False)
    handles = [Patch(color=c, label=f"request {rid}") for rid, c in colours.items()]
    handles += [Patch(facecolor="white", edgecolor="black", label="free"),
                Patch(color="lightgray", label="free, cached"), Patch(color="dimgray", label="null block")]
    ax.legend(handles=handles, loc="upper left", bbox_to_anchor=(1.0, 1.0), fontsize=8, frameon=False)
    return ax


def request_colour(request_id: str) -> tuple[float, float, float, float]:
    """A request keeps its colour from picture to picture, whoever else comes and goes."""
    index = int(request_id) if request_id.isdigit() else sum(map(ord, request_id))
    return plt.get_cmap("tab10")(index % 10)
