"""Train the tiny Llama that ships with nanoserve (nanoserve/data/tiny-llama) on Jane Austen's novels.

The corpus is Jane Austen's six novels (public domain) as the Debian package r-cran-janeaustenr
ships them (MIT). Fetch and unpack it once, without installing R:

    apt-get download r-cran-janeaustenr && dpkg -x r-cran-janeaustenr_*.deb build/janeaustenr
    python scripts/train_tiny_llama.py --threads 1         # 30 min on a shared 2-core CPU

Steps: read the novels out of R's lazy-load database -> paragraphs -> a byte-level BPE tokenizer
(4096 tokens) -> every paragraph as `<s> text </s>` in one token stream -> a small Llama (GQA,
RoPE, RMSNorm, SwiGLU) trained on random windows of that stream -> save_pretrained. Each paragraph
ends with `</s>`, so the model learns to stop. Seeded: a rerun gives a model of the same quality
(CPU kernels may differ in the last bits between machines).
"""
from __future__ import annotations

import argparse
import gzip
import math
import re
import struct
import sys
import time
import zlib
from pathlib import Path

import torch
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers
from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

ROOT = Path(__file__).resolve().parent.parent
BOS, EOS, PAD = "<s>", "</s>", "<pad>"


# ---------------------------------------------------------------------------------------------
# The corpus: R's lazy-load database (data/Rdata.rdx index + data/Rdata.rdb blobs)


class RReader:
    """Just enough of R's XDR serialization format to read character vectors and the index."""

    def __init__(self, data: bytes) -> None:
        if data[:2] != b"X\n":
            raise ValueError("not an R XDR serialization")
        self.data, self.pos, self.refs = data, 2, []
        version = self.read_int()
        self.pos += 8  # writer and minimal reader versions
        if version == 3:
            self.pos += 4 + self.read_int()  # the native encoding's name

    def read_int(self) -> int:
        (value,) = struct.unpack(">i", self.data[self.pos:self.pos + 4])
        self.pos += 4
        return value

    def read(self) -> object:
        """One R object: str, list, None, ('sym', name), or a pairlist as [(tag, value), ...]."""
        flags = self.read_int()
        kind, has_attr, has_tag = flags & 0xFF, flags & (1 << 9), flags & (1 << 10)
        if kind in (241, 242, 253, 254):  # environments and NULL: nothing to read
            return None
        if kind == 255:  # a reference to an earlier symbol
            return self.refs[(flags >> 8 or self.read_int()) - 1]
        if kind == 1:  # symbol
            self.refs.append(("sym", self.read()))
            return self.refs[-1]
        if kind == 2:  # pairlist node: [attributes] [tag] value, then the rest of the list
            if has_attr:
                self.read()  # unused here
            tag = self.read() if has_tag else None
            value = self.read()
            return [(tag, value)] + (self.read() or [])
        if kind == 9:  # one string
            n = self.read_int()
            if n == -1:
                return None  # NA
            self.pos += n
            return self.data[self.pos - n:self.pos].decode("utf-8")
        if kind in (16, 19):  # character vector, list
            items = [self.read() for _ in range(self.read_int())]
        elif kind in (10, 13):  # logical, integer vector
            n = self.read_int()
            items = list(struct.unpack(f">{n}i", self.data[self.pos:self.pos + 4 * n]))
            self.pos += 4 * n
        else:
            raise ValueError(f"R type {kind} not supported")
        if has_attr:
            attributes = dict((tag[1], value) for tag, value in self.read())
            if "names" in attributes:
                return dict(zip(attributes["names"], items))
        return items


def find_corpus(path: Path) -> Path:
    for data in (path / "usr/lib/R/site-library/janeaustenr/data", path / "data", path,
                 Path("/usr/lib/R/site-library/janeaustenr/data")):
        if (data / "Rdata.rdb").is_file():
            return data
    sys.exit(f"Jane Austen's novels not found under {path}. Get them (Debian's r-cran-janeaustenr) with:\n"
             f"    apt-get download r-cran-janeaustenr && dpkg -x r-cran-janeaustenr_*.deb {path}")


def read_novels(data: Path) -> dict[str, list[str]]:
    """{novel: its lines}: the index maps each name to (offset, length) of a compressed blob."""
    index = RReader(gzip.decompress((data / "Rdata.rdx").read_bytes())).read()
    blobs = (data / "Rdata.rdb").read_bytes()
    novels = {}
    for name, (offset, length) in index["variables"].items():
        # each blob: 4-byte uncompressed length, then a zlib stream
        novels[name] = RReader(zlib.decompress(blobs[offset + 4:offset + length])).read()
    return novels


HEADING = re.compile(r"(?i)(chapter|volume) \w+\.?|by( jane austen)?( \(\d{4}\))?|\(\d{4}\)"
                     r"|jane austen|persuasion|the end|finis")


def paragraphs(lines: list[str]) -> list[str]:
    """Blank-line separated paragraphs, each on one line; headings and _italics_ marks dropped."""
    out, current = [], []
    for line in lines + [""]:
        if line.strip():
            current.append(line.strip())
            continue
        text = re.sub(r"\s+", " ", " ".join(current)).replace("_", "").strip()
        current = []
        if text and text.upper() != text and not HEADING.fullmatch(text):  # all caps: a title
            out.append(text)
    return out


# ---------------------------------------------------------------------------------------------
# Tokenizer and data


def train_tokenizer(texts: list[str], vocab_size: int, model_max_length: int) -> PreTrainedTokenizerFast:
    """Byte-level BPE (GPT-2 style) whose encode() prepends <s>, as Llama tokenizers do."""
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=[PAD, BOS, EOS],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    tok.train_from_iterator(texts, trainer)
    tok.post_processor = processors.TemplateProcessing(single=f"{BOS} $A", special_tokens=[(BOS, 1)])
    return PreTrainedTokenizerFast(tokenizer_object=tok, bos_token=BOS, eos_token=EOS, pad_token=PAD,
                                   add_bos_token=True, clean_up_tokenization_spaces=False,
                                   model_max_length=model_max_length)


def encode(tokenizer: PreTrainedTokenizerFast, texts: list[str]) -> torch.Tensor:
    """All texts as one stream `<s> a </s> <s> b </s> ...`; [num_tokens] int64."""
    ids = tokenizer(texts, verbose=False)["input_ids"]  # each starts with <s>; paragraphs may exceed seq_len
    return torch.tensor([t for seq in ids for t in seq + [tokenizer.eos_token_id]])


def sample_windows(stream: torch.Tensor, batch_size: int, seq_len: int, gen: torch.Generator) -> torch.Tensor:
    starts = torch.randint(0, len(stream) - seq_len, (batch_size,), generator=gen)
    return torch.stack([stream[s:s + seq_len] for s in starts.tolist()])  # [batch_size, seq_len]


# ---------------------------------------------------------------------------------------------
# Training


def lr_at(step: int, args: argparse.Namespace) -> float:
    """Linear warmup, then cosine decay to a tenth of the peak."""
    if step < args.warmup:
        return args.lr * (step + 1) / args.warmup
    progress = (step - args.warmup) / max(1, args.steps - args.warmup)
    return args.lr * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * progress)))


@torch.no_grad()
def evaluate(model: LlamaForCausalLM, stream: torch.Tensor, seq_len: int) -> float:
    """Mean loss over consecutive windows of the held-out stream."""
    model.eval()
    windows = stream[:len(stream) // seq_len * seq_len].view(-1, seq_len)  # [num_windows, seq_len]
    losses = [model(input_ids=w, labels=w).loss.item() for w in windows.split(16)]
    model.train()
    return sum(losses) / len(losses)


def prepare_data(args: argparse.Namespace) -> tuple[PreTrainedTokenizerFast, torch.Tensor, torch.Tensor]:
    """The tokenizer, the training stream and the held-out stream (every 100th paragraph)."""
    novels = read_novels(find_corpus(args.corpus))
    texts = [p for name in sorted(novels) for p in paragraphs(novels[name])]
    held_out = texts[::100]
    train_texts = [t for i, t in enumerate(texts) if i % 100]
    tokenizer = train_tokenizer(train_texts, args.vocab_size, args.seq_len)
    train_stream, val_stream = encode(tokenizer, train_texts), encode(tokenizer, held_out)
    print(f"{len(novels)} novels, {len(texts)} paragraphs, {len(train_stream):,} training tokens, "
          f"{len(val_stream):,} held out", flush=True)
    return tokenizer, train_stream, val_stream


def build_model(args: argparse.Namespace, tokenizer: PreTrainedTokenizerFast) -> LlamaForCausalLM:
    """A Llama as nanoserve serves it: GQA (kv_heads < heads), RoPE, RMSNorm, SwiGLU, tied embeddings."""
    config = LlamaConfig(vocab_size=args.vocab_size, hidden_size=args.dim, num_hidden_layers=args.layers,
                         num_attention_heads=args.heads, num_key_value_heads=args.kv_heads,
                         intermediate_size=args.ffn_dim, max_position_embeddings=args.seq_len,
                         tie_word_embeddings=True, initializer_range=0.02, pad_token_id=0,
                         bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id)
    model = LlamaForCausalLM(config)
    model.generation_config.pad_token_id = 0
    print(f"{sum(p.numel() for p in model.parameters()):,} parameters", flush=True)
    return model


def train(args: argparse.Namespace) -> None:
    torch.set_num_threads(args.threads)
    torch.manual_seed(args.seed)
    start = time.perf_counter()
    tokenizer, train_stream, val_stream = prepare_data(args)
    model = build_model(args, tokenizer)
    decay = [p for p in model.parameters() if p.dim() >= 2]
    no_decay = [p for p in model.parameters() if p.dim() < 2]  # norms
    optimizer = torch.optim.AdamW([{"params": decay, "weight_decay": 0.1}, {"params": no_decay, "weight_decay": 0.0}],
                                  lr=args.lr, betas=(0.9, 0.95), fused=True)
    gen = torch.Generator().manual_seed(args.seed)
    train_start, recent, last = time.perf_counter(), [], []
    for step in range(args.steps):
        for group in optimizer.param_groups:
            group["lr"] = lr_at(step, args)
        x = sample_windows(train_stream, args.batch_size, args.seq_len, gen)  # [B, T]
        loss = model(input_ids=x, labels=x).loss  # labels are shifted inside the model
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        recent.append(loss.item())
        last = (last + [loss.item()])[-args.log_every:]
        if (step + 1) % args.log_every == 0 or step + 1 == args.steps:
            seconds = time.perf_counter() - train_start
            print(f"step {step + 1}/{args.steps}  loss {sum(recent) / len(recent):.3f}  "
                  f"{(step + 1) * x.numel() / seconds:.0f} tok/s  {seconds / 60:.1f} min", flush=True)
            recent = []
    val_loss = evaluate(model, val_stream, args.seq_len)
    model.save_pretrained(args.out)
    tokenizer.save_pretrained(args.out)
    print(f"final train loss {sum(last) / len(last):.3f} (mean of the last {len(last)} steps), "
          f"held-out loss {val_loss:.3f}, training {(time.perf_counter() - train_start) / 60:.1f} min, "
          f"total {(time.perf_counter() - start) / 60:.1f} min; saved to {args.out}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--corpus", type=Path, default=ROOT / "build/janeaustenr",
                        help="where r-cran-janeaustenr was unpacked")
    parser.add_argument("--out", type=Path, default=ROOT / "nanoserve/data/tiny-llama")
    parser.add_argument("--steps", type=int, default=2000)
    parser.add_argument("--batch-size", type=int, default=8)
    parser.add_argument("--seq-len", type=int, default=256, help="also the model's max_position_embeddings")
    parser.add_argument("--lr", type=float, default=2e-3)
    parser.add_argument("--warmup", type=int, default=100)
    parser.add_argument("--vocab-size", type=int, default=4096)
    parser.add_argument("--dim", type=int, default=256)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--heads", type=int, default=8)
    parser.add_argument("--kv-heads", type=int, default=4)
    parser.add_argument("--ffn-dim", type=int, default=688)
    parser.add_argument("--threads", type=int, default=2, help="1 is faster on a busy machine")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--log-every", type=int, default=50)
    train(parser.parse_args())


if __name__ == "__main__":
    main()
