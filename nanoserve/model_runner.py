"""The model runner: owns the model, the KV cache and the sampler, and runs one Batch per step.

Planning (scheduler, block_manager) never touches tensors. Here a plan, flattened into a `Batch`
(batch.py), meets the weights and the KV cache. With tensor parallelism every rank has a ModelRunner.
It holds the rank's shard of the model and of the KV cache (distributed.py). Rank 0's is a
`TensorParallelRunner` (parallel.py), which also drives the other ranks.
"""

import torch

from nanoserve.attention import select_attention
from nanoserve.batch import Batch, build_batch, prompt_logprob_positions, sampling_rows
from nanoserve.config import CPU_KV_CACHE_FRACTION, Config, cdiv
from nanoserve.device import free_memory, resolve_dtype
from nanoserve.distributed import Shard, broadcast_from_rank0
from nanoserve.models.loader import Checkpoint, load_model
from nanoserve.sampler import SamplerOutput, SamplingParams, sample, top_logprobs
from nanoserve.seams import Seams
from nanoserve.sequence import ScheduledSeq, Sequence
from nanoserve.tokenizer import read_eos_token_ids


class ModelRunner:
    """Loads the model (`shard`'s part of it) and a KV cache on `device`, and runs one Batch per step.
    Rank 0's runner also samples.

    `checkpoint` is its config.json as the engine read it (loader.py). The dtype, head_dim and the model
    follow from it. Where the ranks of a group run, they must be in it already (parallel.py).
    `seams` holds the extensions that enter here (seams.py): the weight transform, the step executor and
    the logits processor."""

    healthy = True  # can this runner still run steps? One process always can (see TensorParallelRunner)

    def __init__(self, config: Config, device: torch.device, max_model_len: int, checkpoint: Checkpoint,
                 shard: Shard = Shard(), seams: Seams = Seams()) -> None:
        self.shard, self.device, self.logits_processor = shard, device, seams.logits_processor
        self.dtype = resolve_dtype(config.dtype, device, checkpoint.config.dtype)
        self.backend, self.block_size = select_attention(config.attention_backend, config.block_size, device,
                                                         self.dtype, checkpoint.family.head_dim)
        compiled_one_row = not config.enforce_eager and config.max_num_seqs == 1  # layers/linear.py's choice
        self.model = load_model(checkpoint, self.dtype, device, self.backend, shard, compiled_one_row,
                                seams.weight_transform)
        # not enforce_eager: compiled now, before any request, or eager after one log line (compilation.py)
        self.compiled = seams.executor.compile(self)
        if device.type == "cuda":  # the largest step, once: its peak is what the KV cache leaves free
            torch.cuda.reset_peak_memory_stats(device)
            self.warm_up(config, max_model_len)
            torch.cuda.empty_cache()  # the free memory read next counts the warm-up's as free
        # Rank 0 decides how many blocks; every rank's cache then holds as many, so one block table fits all.
        num_blocks = config.num_kvcache_blocks or self.size_kv_cache(config, max_model_len) if shard.rank == 0 else None
        self.num_blocks = broadcast_from_rank0(num_blocks, shard)
        needed, available = self.num_blocks * self.bytes_per_block(), free_memory(device)[0]
        if needed > available:
            raise ValueError(f"num_kvcache_blocks={self.num_blocks} needs {needed / 2**30:.2f} GiB for the KV cache, "
                             f"but only {available / 2**30:.2f} GiB of {device.type} memory is free")
        self.kv_cache = self.allocate_kv_cache(self.num_blocks)
        # decode steps' own runner (CUDA graphs, not enforce_eager), or None: the model runs them
        self.graphs = seams.executor.capture(self, max_model_len)
        self.eos_token_ids = read_eos_token_ids(config.model, checkpoint.config)  # min_tokens bans them

    def allocate_kv_cache(self, num_blocks: int, device: torch.device | str | None = None) -> torch.Tensor:
        """[2 (k and v), num_layers, num_blocks, block_size, num_kv_heads, head_dim].
        That is flash-attn's paged layout per layer, with this rank's KV heads. It is zeros, not empty,
        because padding slots are read (and masked). It is on this runner's device unless told. On "meta"
        it has its shape and size alone (no memory)."""
        m = self.model
        return torch.zeros(2, m.num_layers, num_blocks, self.block_size, m.num_kv_heads, m.head_dim,
                           dtype=self.dtype, device=device or self.device)

    def bytes_per_block(self) -> int:
        """One block's KV bytes in this device's memory: this rank's, times the ranks sharing a CPU's RAM."""
        ranks_here = self.shard.size if self.device.type == "cpu" else 1
        return ranks_here * self.allocate_kv_cache(1, "meta").nbytes

    def size_kv_cache(self, config: Config, max_model_len: int) -> int:
        """How many blocks fit the memory budget.
        - On a GPU: `gpu_memory_utilization` of it, less what is in use and the warm-up's peak above it
          (see warm_up).
        - On a CPU: CPU_KV_CACHE_FRACTION of available RAM. The other 90% is far more than any step's
          activations.
        It is never more than every seat filled to max_model_len. Too few for one request is an error the
        engine reports. The cache never goes over budget."""
        free, total = free_memory(self.device)
        if self.device.type == "cuda":
            peak = torch.cuda.max_memory_allocated(self.device) - torch.cuda.memory_allocated(self.device)
            budget = free - (1 - config.gpu_memory_utilization) * total - peak
        else:
            budget = CPU_KV_CACHE_FRACTION * free
        most_needed = config.max_num_seqs * cdiv(max_model_len, self.block_size) + 1
        return max(0, min(int(budget // self.bytes_per_block()), most_needed))

    @torch.inference_mode()
    def warm_up(self, config: Config, max_model_len: int) -> None:
        """Run the largest step the scheduler can make, once, on a throwaway KV cache.

        That is a forward over max_num_batched_tokens prompt tokens, in requests of up to max_model_len.
        Then it samples max_num_seqs rows with top-k and top-p, the sampler's costliest path. Its peak is
        what the KV cache must leave free, as vLLM and nano-vllm measure it. The peak holds activations,
        logits, and the sampler's [rows, vocab] copies. Every rank runs it, because the forward's
        collectives need them all."""
        seq_len = min(config.max_num_batched_tokens, max_model_len)
        num_blocks = 1 + cdiv(seq_len, self.block_size)  # of a throwaway cache: seq's blocks and the null block 0
        seq = Sequence("warm-up", None, [0] * seq_len, SamplingParams())
        seq.block_table = list(range(1, num_blocks))
        # the same request, as many times as fit: a batch reads only their tokens and blocks, never who they are
        num_seqs = min(config.max_num_batched_tokens // seq_len, config.max_num_seqs)
        batch = build_batch([(seq, seq_len)] * num_seqs, self.block_size, self.device)
        self.model(batch, self.allocate_kv_cache(num_blocks))
        if self.shard.rank == 0:
            logits = torch.zeros(config.max_num_seqs, self.model.vocab_size, device=self.device)
            sample(logits, [SamplingParams(top_k=50, top_p=0.9)] * len(logits), [0] * len(logits))

    @torch.inference_mode()
    def run(self, batch: Batch, scheduled: list[ScheduledSeq]) -> SamplerOutput:
        """One forward pass over the flat batch, then the sampled tokens with the logprobs asked for.
        Each request that samples now gets one token, and one per draft it verifies (spec_decode.py).
        A worker has no `scheduled`, since rank 0 samples. It returns nothing."""
        # [S + P, vocab]: the rows that sample, then prompt-logprob rows; decode steps replay a graph where captured
        logits = (self.graphs.replay(batch) if self.graphs and batch.is_decode_only else
                  self.model(batch, self.kv_cache))
        if not scheduled:
            return SamplerOutput([], [], [])
        seqs, num_generated = sampling_rows(scheduled)  # a row per request that samples, one per draft (batch.py)
        sampling, prompt_rows = logits[:len(seqs)], logits[len(seqs):]  # [S, vocab], [P, vocab]
        # penalties, grammars...: logits_processors.py (a request using them has no drafts: one row each)
        processed = self.logits_processor(sampling, seqs, self.eos_token_ids)
        token_ids = sample(processed, [s.params for s in seqs], num_generated)
        logprobs = [None] * len(seqs)  # a row's stays None unless its request asked for logprobs
        rows = [row for row, seq in enumerate(seqs) if seq.params.logprobs is not None]
        if rows:
            chosen = torch.tensor(token_ids, device=logits.device)[rows]  # [len(rows)]
            for row, found in zip(rows, top_logprobs(sampling[rows], chosen, [seqs[r].params.logprobs for r in rows])):
                logprobs[row] = found
        num_top = [seq.params.prompt_logprobs for (seq, _), rows in zip(scheduled, prompt_logprob_positions(scheduled))
                   for _ in rows]
        return SamplerOutput(token_ids, logprobs, top_logprobs(prompt_rows, batch.next_token_ids, num_top))

    def close(self) -> None:
        """Nothing to release for one process (see TensorParallelRunner.close)."""
