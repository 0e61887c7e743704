"""Data: the embedded Shakespeare + Milton corpus (offline default) or C4, a byte-level BPE tokenizer,
token ids in numpy memmaps, and a seeded sampler whose micro-batch is a pure function of
(seed, step, rank, micro-batch index).

Sampling. The training split's token stream is cut into non-overlapping windows of seq_len + 1 tokens,
starting at a random offset that changes every epoch; the windows are shuffled per epoch. Global sample
number  g = ((step * n_ranks + rank) * grad_accum + micro) * batch_size + j  reads window perm_e[g mod W]
of epoch e = g div W. Within an epoch no window is read twice, so ranks, steps and micro-batches draw
disjoint data, and any rank can compute any other rank's micro-batch (the neighbour does).
"""

from __future__ import annotations

import functools
import gzip
import hashlib
import json
import os
import sys
import tarfile
from dataclasses import dataclass
from pathlib import Path
from typing import Iterable, Iterator

import numpy as np

from .errors import UsageError

CORPUS_DIR = Path(__file__).parent / "corpus"
EOS = "<|endoftext|>"

# Whole works held out (one comedy and one tragedy each); everything else, Milton included, is training text.
HELD_OUT = {
    "val": ("twelfth_night", "julius_caesar"),
    "test": ("much_ado_about_nothing", "macbeth"),
}
SPLITS = ("train", "val", "test")
C4_DOWNLOAD_HINT = (
    "download shards of allenai/c4 'en' (e.g. en/c4-train.00000-of-01024.json.gz and "
    "en/c4-validation.00000-of-00008.json.gz from https://huggingface.co/datasets/allenai/c4) "
    "into a folder and pass it as --data_dir"
)


def cache_dir() -> Path:
    """$MECEFO_CACHE, else ~/.cache/mecefo."""
    return Path(os.environ.get("MECEFO_CACHE", Path.home() / ".cache" / "mecefo"))


def _sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


# ---------------------------------------------------------------------------------------------- corpus
def verify_corpus(corpus_dir: Path | None = None) -> Path:
    """The archive's path, after checking its SHA-256 against manifest.json (a few ms)."""
    corpus_dir = Path(corpus_dir or CORPUS_DIR)
    manifest = json.loads((corpus_dir / "manifest.json").read_text())
    archive = corpus_dir / manifest["archive"]
    if not archive.exists():
        raise UsageError(f"corpus archive {archive} is missing; restore it from git")
    if _sha256(archive) != manifest["archive_sha256"]:
        raise UsageError(f"corpus archive {archive} is corrupted (SHA-256 mismatch); restore it from git")
    return archive


def load_corpus(corpus_dir: Path | None = None) -> dict[str, str]:
    """All works of the embedded corpus, {work name: text}, after checking the archive's SHA-256."""
    corpus_dir = Path(corpus_dir or CORPUS_DIR)
    archive = verify_corpus(corpus_dir)
    manifest = json.loads((corpus_dir / "manifest.json").read_text())
    works = {}
    with tarfile.open(archive, "r:xz") as tar:
        for name, meta in manifest["works"].items():
            works[name] = tar.extractfile(meta["file"]).read().decode("utf-8")
    return works


def split_of(work: str) -> str:
    for split, held in HELD_OUT.items():
        if work in held:
            return split
    return "train"


def shakespeare_documents(split: str) -> list[str]:
    """The works of one split, in name order."""
    return [text for name, text in sorted(load_corpus().items()) if split_of(name) == split]


# ---------------------------------------------------------------------------------------------- C4
def shard_folder(data_dir: str) -> Path:
    """The folder holding the c4-*.json.gz shards: data_dir itself, or its en/ (Hugging Face's allenai/c4 copy
    keeps the English shards there)."""
    folder = Path(data_dir)
    if not any(folder.glob("c4-*.json.gz")) and any((folder / "en").glob("c4-*.json.gz")):
        return folder / "en"
    return folder


def c4_documents(split: str, data_dir: str | None) -> Iterator[str]:
    """Texts of allenai/c4 'en' (`split` is train or validation): local c4-<split>.*.json.gz shards from
    data_dir, else streamed through `datasets` (needs a network and `pip install datasets`)."""
    if data_dir:
        shards = sorted(shard_folder(data_dir).glob(f"c4-{split}.*.json.gz"))
        if not shards:
            raise UsageError(f"--data_dir {data_dir} holds no c4-{split}.*.json.gz shards; {C4_DOWNLOAD_HINT}")
        for shard in shards:
            with gzip.open(shard, "rt", encoding="utf-8") as f:
                for line in f:
                    yield json.loads(line)["text"]
        return
    try:
        import datasets  # optional dependency (pip install -e .[c4])

        stream = datasets.load_dataset("allenai/c4", "en", split=split, streaming=True)
        for row in stream:
            yield row["text"]
    except Exception as e:  # no package, no network, hub refused: all the same to the user
        raise UsageError(f"cannot stream allenai/c4 ({type(e).__name__}); {C4_DOWNLOAD_HINT}") from None


# ---------------------------------------------------------------------------------------------- tokenizer
def train_tokenizer(texts: Iterable[str], vocab_size: int):
    """Byte-level BPE (GPT-2 style pre-tokenization, 256 byte symbols, one <|endoftext|> token)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    if vocab_size < 257 + 1:
        raise UsageError(f"vocab_size={vocab_size} must be at least 258 (256 bytes, EOS and one merge)")
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=[EOS], show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(texts, trainer=trainer)
    return tok


def _write_tokens(docs: Iterable[str], tok, path: Path, max_tokens: int | None, dtype) -> int:
    """Encode documents (EOS after each) into a flat binary file of `dtype` ids; returns the count."""
    eos, n = tok.token_to_id(EOS), 0
    with open(path, "wb") as f:
        batch: list[str] = []

        def flush() -> bool:
            nonlocal n
            for enc in tok.encode_batch(batch):
                ids = np.asarray(enc.ids + [eos], dtype=dtype)
                if max_tokens is not None:
                    ids = ids[: max_tokens - n]
                ids.tofile(f)
                n += len(ids)
                if max_tokens is not None and n >= max_tokens:
                    return True
            batch.clear()
            return False

        for doc in docs:
            batch.append(doc)
            if len(batch) == 256 and flush():
                return n
        flush()
    return n


@dataclass(frozen=True)
class DataConfig:
    dataset: str = "shakespeare"  # shakespeare | c4
    vocab_size: int = 4096  # BPE vocabulary trained on the training split (a tokenizer_file brings its own)
    seq_len: int = 256  # tokens per window
    micro_batch_size: int = 8  # sequences per rank per micro-batch
    grad_accum: int = 1  # micro-batches per rank per optimizer step
    data_dir: str = ""  # c4: folder of local json.gz shards ("" = stream with `datasets`)
    tokenizer_file: str = ""  # a tokenizers JSON file to use instead of training BPE (e.g. T5's)
    c4_train_tokens: int = 20_000_000  # c4: tokens of the training stream kept in the memmap (0: sized to the run, one pass: see run_tokens)
    c4_val_tokens: int = 2_000_000  # c4: tokens of the validation stream kept
    c4_tokenizer_docs: int = 100_000  # c4: documents the BPE is trained on
    val_windows: int = 64  # validation/test windows of seq_len tokens (0: every window of the split)

    def validate(self) -> None:
        if self.dataset not in ("shakespeare", "c4"):
            raise UsageError(f"data.dataset={self.dataset!r}; allowed: 'shakespeare', 'c4'")
        for name in ("vocab_size", "seq_len", "micro_batch_size", "grad_accum",
                     "c4_train_tokens", "c4_val_tokens", "c4_tokenizer_docs"):
            if getattr(self, name) < 1:
                raise UsageError(f"data.{name}={getattr(self, name)} must be a positive integer")
        if self.val_windows < 0:
            raise UsageError(f"data.val_windows={self.val_windows} must be a positive integer, or 0 for the whole split")
        if self.tokenizer_file and not Path(self.tokenizer_file).is_file():
            raise UsageError(f"data.tokenizer_file={self.tokenizer_file!r} does not exist")


# C4's English variant as published (allenai/c4 on Hugging Face: en/c4-train.NNNNN-of-01024.json.gz, 305 GB for the
# variant; Dodge et al. 2021, "Documenting Large Webtext Corpora", Table 1: 365M documents, 156B tokens with T5's
# tokenizer). Per shard, on average: the sizes a download is planned with (our BPE counts differ by some percent).
C4_EN_TRAIN_SHARDS = 1024
C4_EN_TOKENS_PER_SHARD = 156e9 / C4_EN_TRAIN_SHARDS
C4_EN_GB_PER_SHARD = 305 / C4_EN_TRAIN_SHARDS


def c4_download(tokens: int, margin: float = 1.1) -> dict:
    """How many of C4's English train shards hold `tokens` (with a margin for our tokenizer's counts), their size, and
    the --include patterns of `huggingface-cli download allenai/c4` that fetch the first ones (and the validation)."""
    import math

    shards = min(C4_EN_TRAIN_SHARDS, math.ceil(margin * tokens / C4_EN_TOKENS_PER_SHARD))
    patterns, done = [], 0
    for block in (100, 10):  # whole hundreds, then whole tens, then the last ones as a character class
        while shards - done >= block:
            patterns.append(f"{done // block:0{5 - len(str(block)) + 1}d}" + "?" * (len(str(block)) - 1))
            done += block
    if shards > done:
        last = shards - done - 1
        patterns.append(f"{done // 10:04d}" + (f"[0-{last}]" if last else "0"))
    return {"shards": shards, "gigabytes": round(shards * C4_EN_GB_PER_SHARD, 1),
            "include": [f"en/c4-train.{p}-of-01024.json.gz" for p in patterns]
            + ["en/c4-validation.00000-of-00008.json.gz"]}


def run_tokens(steps: int, ranks: int, dc: DataConfig) -> int:
    """The training tokens one pass of a run reads: steps x ranks x grad_accum x micro_batch_size windows of seq_len + 1
    tokens (windows do not overlap), and one window more for the epoch's random offset. data.c4_train_tokens = 0 keeps
    this many, so that a paper-scale run never repeats a window."""
    return (steps * ranks * dc.grad_accum * dc.micro_batch_size + 1) * (dc.seq_len + 1)


class TokenData:
    """Token memmaps for train/val/test and the tokenizer, built once and cached under cache_dir()."""

    def __init__(self, cfg: DataConfig):
        cfg.validate()
        self.cfg = cfg
        self.dir = _prepare(cfg)
        self.meta = json.loads((self.dir / "meta.json").read_text())
        dtype = np.dtype(self.meta["dtype"])
        self.tokens = {s: np.memmap(self.dir / f"{s}.bin", dtype=dtype, mode="r") for s in self.meta["splits"]}
        for s, arr in self.tokens.items():
            if len(arr) < 2 * (cfg.seq_len + 1):
                raise UsageError(f"the {s} split has {len(arr)} tokens, too few for data.seq_len={cfg.seq_len}")

    @functools.cached_property
    def tokenizer(self):
        from tokenizers import Tokenizer

        return Tokenizer.from_file(str(self.dir / "tokenizer.json"))

    @property
    def vocab_size(self) -> int:
        return self.meta["vocab_size"]

    @property
    def splits(self) -> list[str]:
        """The splits this source has: train, val and test for Shakespeare; train and val for C4, which publishes
        train and validation only (the paper reports validation perplexity)."""
        return list(self.meta["splits"])

    def _windows(self) -> int:
        return (len(self.tokens["train"]) - self.cfg.seq_len - 1) // (self.cfg.seq_len + 1)

    @functools.lru_cache(maxsize=4)
    def _epoch(self, seed: int, epoch: int) -> tuple[int, np.ndarray]:
        rng = np.random.default_rng([seed, epoch])
        return int(rng.integers(0, self.cfg.seq_len + 1)), rng.permutation(self._windows())

    def epoch_order(self, seed: int, epoch: int) -> tuple[int, np.ndarray]:
        """The epoch's window offset and its permutation of the W windows (read from its head, W per epoch)."""
        return self._epoch(seed, epoch)

    def micro_batch(self, seed: int, step: int, rank: int = 0, micro: int = 0, n_ranks: int = 1) -> tuple[np.ndarray, np.ndarray]:
        """Inputs and next-token targets, int64 arrays (micro_batch_size, seq_len)."""
        b, t, accum = self.cfg.micro_batch_size, self.cfg.seq_len, self.cfg.grad_accum
        if not (0 <= rank < n_ranks and 0 <= micro < accum and step >= 0):
            raise ValueError(f"bad sample address step={step} rank={rank}/{n_ranks} micro={micro}/{accum}")
        g0 = ((step * n_ranks + rank) * accum + micro) * b
        w = self._windows()
        rows = []
        for g in range(g0, g0 + b):
            offset, perm = self._epoch(seed, g // w)
            start = offset + int(perm[g % w]) * (t + 1)
            rows.append(self.tokens["train"][start : start + t + 1])
        xy = np.stack(rows).astype(np.int64)
        return xy[:, :-1], xy[:, 1:]

    def eval_batches(self, split: str = "val", batch: int | None = None) -> Iterator[tuple[np.ndarray, np.ndarray]]:
        """A fixed set of val_windows non-overlapping windows spread evenly over the split (all of them for
        val_windows = 0), in batches of `batch` windows (default: micro_batch_size)."""
        arr, t, b = self.tokens[split], self.cfg.seq_len, batch or self.cfg.micro_batch_size
        available = (len(arr) - 1) // t
        count = available if self.cfg.val_windows == 0 else min(self.cfg.val_windows, available)
        starts = (np.linspace(0, available - 1, num=count).astype(np.int64)) * t
        for i in range(0, len(starts), b):
            xy = np.stack([arr[s : s + t + 1] for s in starts[i : i + b]]).astype(np.int64)
            yield xy[:, :-1], xy[:, 1:]


def _source_key(cfg: DataConfig) -> dict:
    key = {"dataset": cfg.dataset, "vocab_size": cfg.vocab_size, "version": 1}
    if cfg.tokenizer_file:
        key["tokenizer_sha256"] = _sha256(Path(cfg.tokenizer_file))
    if cfg.dataset == "shakespeare":
        key["corpus_sha256"] = _sha256(verify_corpus())
    else:
        key.update(c4_train_tokens=cfg.c4_train_tokens, c4_val_tokens=cfg.c4_val_tokens,
                   c4_tokenizer_docs=cfg.c4_tokenizer_docs)
        if cfg.data_dir:
            key["shards"] = sorted((p.name, p.stat().st_size) for p in shard_folder(cfg.data_dir).glob("c4-*.json.gz"))
    return key


def _prepare(cfg: DataConfig) -> Path:
    """Build (or find) the cache folder keyed by the data source, its checksum and the vocab size."""
    key = _source_key(cfg)
    digest = hashlib.sha256(json.dumps(key, sort_keys=True).encode()).hexdigest()[:16]
    out = cache_dir() / "tokens" / f"{cfg.dataset}-v{cfg.vocab_size}-{digest}"
    if (out / "meta.json").exists():
        return out
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.with_name(f"{out.name}.tmp{os.getpid()}")
    tmp.mkdir()
    from tokenizers import Tokenizer

    if cfg.dataset == "shakespeare":
        docs = {s: shakespeare_documents(s) for s in SPLITS}
        limits = {s: None for s in SPLITS}
        tok_texts: Iterable[str] = docs["train"]
    else:
        docs = {"train": c4_documents("train", cfg.data_dir), "val": c4_documents("validation", cfg.data_dir)}
        limits = {"train": cfg.c4_train_tokens, "val": cfg.c4_val_tokens}
        tok_texts = list(_take(c4_documents("train", cfg.data_dir), cfg.c4_tokenizer_docs))
    tok = Tokenizer.from_file(cfg.tokenizer_file) if cfg.tokenizer_file else train_tokenizer(tok_texts, cfg.vocab_size)
    if tok.token_to_id(EOS) is None:
        tok.add_special_tokens([EOS])
    vocab = tok.get_vocab_size()
    dtype = np.uint16 if vocab <= np.iinfo(np.uint16).max else np.uint32
    counts = {s: _write_tokens(d, tok, tmp / f"{s}.bin", limits[s], dtype) for s, d in docs.items()}
    if limits["train"] is not None and counts["train"] < limits["train"]:
        print(f"warning: the C4 shards hold {counts['train']:,} training tokens, fewer than data.c4_train_tokens="
              f"{limits['train']:,}: windows will repeat (download more shards: mecefo.data.c4_download)", file=sys.stderr)
    tok.save(str(tmp / "tokenizer.json"))
    meta = {"key": key, "vocab_size": vocab, "dtype": np.dtype(dtype).name, "splits": list(docs), "tokens": counts}
    (tmp / "meta.json").write_text(json.dumps(meta, indent=1))
    try:
        tmp.rename(out)
    except OSError:  # another process (e.g. another torchrun rank) finished first: use its copy
        import shutil

        shutil.rmtree(tmp, ignore_errors=True)
    return out


def _take(it: Iterable[str], n: int) -> Iterator[str]:
    for i, x in enumerate(it):
        if i >= n:
            return
        yield x
