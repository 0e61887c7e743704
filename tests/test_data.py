import shutil

import numpy as np
import pytest

from mecefo import data as data_mod
from mecefo.data import HELD_OUT, DataConfig, TokenData, load_corpus, split_of, train_tokenizer
from mecefo.errors import UsageError

from .conftest import write_c4_shard


@pytest.fixture(scope="module")
def nano_data():
    return TokenData(DataConfig(vocab_size=512, seq_len=64, micro_batch_size=4, grad_accum=2))


def test_corpus_loads_with_all_works():
    works = load_corpus()
    assert len(works) == 49
    assert "To be, or not to be" in works["hamlet"]
    assert "Of Mans First Disobedience" in works["milton_paradise_lost_no_introduction"]


def test_corrupted_corpus_is_a_clear_error(tmp_path, monkeypatch):
    shutil.copytree(data_mod.CORPUS_DIR, tmp_path / "corpus")
    archive = tmp_path / "corpus" / "shakespeare_milton.tar.xz"
    raw = bytearray(archive.read_bytes())
    raw[1000] ^= 0xFF
    archive.write_bytes(bytes(raw))
    monkeypatch.setattr(data_mod, "CORPUS_DIR", tmp_path / "corpus")
    with pytest.raises(UsageError, match="corrupted"):
        load_corpus()
    monkeypatch.setenv("MECEFO_CACHE", str(tmp_path / "cache"))
    with pytest.raises(UsageError, match="corrupted"):
        TokenData(DataConfig(vocab_size=512))


def test_split_holds_out_whole_works_and_is_disjoint():
    works = load_corpus()
    splits = {s: {w for w in works if split_of(w) == s} for s in ("train", "val", "test")}
    assert splits["val"] == set(HELD_OUT["val"]) and splits["test"] == set(HELD_OUT["test"])
    assert not (splits["train"] & splits["val"]) and not (splits["train"] & splits["test"])
    assert not (splits["val"] & splits["test"])
    assert sum(map(len, splits.values())) == len(works)


def test_tokenizer_round_trip_on_corpus_text(nano_data):
    text = load_corpus()["macbeth"][5000:9000]
    tok = nano_data.tokenizer
    assert tok.decode(tok.encode(text).ids) == text


def test_tokenizer_training_is_deterministic():
    texts = [t[:20000] for _, t in sorted(load_corpus().items())[:6]]
    a, b = train_tokenizer(texts, 400), train_tokenizer(texts, 400)
    assert a.to_str() == b.to_str()


def test_memmaps_cover_each_split(nano_data):
    assert set(nano_data.tokens) == {"train", "val", "test"}
    assert nano_data.tokens["train"].max() < nano_data.vocab_size
    assert len(nano_data.tokens["train"]) > 10 * len(nano_data.tokens["val"])


def test_micro_batch_is_a_pure_function_of_its_address(nano_data):
    x1, y1 = nano_data.micro_batch(seed=3, step=5, rank=1, micro=1, n_ranks=4)
    x2, y2 = nano_data.micro_batch(seed=3, step=5, rank=1, micro=1, n_ranks=4)
    assert np.array_equal(x1, x2) and np.array_equal(y1, y2)
    assert np.array_equal(x1[:, 1:], y1[:, :-1])  # targets are the inputs shifted by one
    assert x1.shape == (4, 64)
    x3, _ = nano_data.micro_batch(seed=4, step=5, rank=1, micro=1, n_ranks=4)
    assert not np.array_equal(x1, x3)


def test_ranks_steps_and_micro_batches_read_disjoint_windows(nano_data):
    seen = set()
    for step in range(3):
        for rank in range(4):
            for micro in range(2):
                x, _ = nano_data.micro_batch(seed=0, step=step, rank=rank, micro=micro, n_ranks=4)
                for row in x:
                    seen.add(row.tobytes())
    assert len(seen) == 3 * 4 * 2 * 4


def test_eval_windows_are_fixed(nano_data):
    a = [x for x, _ in nano_data.eval_batches("val")]
    b = [x for x, _ in nano_data.eval_batches("val")]
    assert all(np.array_equal(u, v) for u, v in zip(a, b))
    assert sum(len(x) for x in a) == DataConfig().val_windows


def test_whole_split_evaluation_covers_every_window_once_in_any_batching(nano_data):
    """val_windows = 0 takes every non-overlapping window of the split; the batching changes nothing else."""
    whole = TokenData(DataConfig(vocab_size=512, seq_len=64, micro_batch_size=4, val_windows=0))
    arr = whole.tokens["val"]
    by4 = np.concatenate([x for x, _ in whole.eval_batches("val")])
    by7 = np.concatenate([x for x, _ in whole.eval_batches("val", batch=7)])
    assert len(by4) == (len(arr) - 1) // 64 and np.array_equal(by4, by7)
    assert np.array_equal(by4[:, 0], arr[np.arange(len(by4)) * 64])  # consecutive windows, none skipped
    with pytest.raises(UsageError, match="val_windows"):
        DataConfig(val_windows=-1).validate()


def test_c4_loads_from_local_shards(tmp_path, monkeypatch):
    monkeypatch.setenv("MECEFO_CACHE", str(tmp_path / "cache"))
    write_c4_shard(tmp_path, "train", 300, 0)
    write_c4_shard(tmp_path, "validation", 40, 1)
    cfg = DataConfig(dataset="c4", data_dir=str(tmp_path), vocab_size=300, seq_len=32, micro_batch_size=2,
                     c4_train_tokens=5000, c4_val_tokens=1000, c4_tokenizer_docs=100, val_windows=8)
    d = TokenData(cfg)
    assert set(d.tokens) == {"train", "val"}
    assert len(d.tokens["train"]) == 5000 and len(d.tokens["val"]) == 1000
    x, _ = d.micro_batch(seed=0, step=0)
    assert "crawled" in d.tokenizer.decode(list(x.ravel())) or "corpus" in d.tokenizer.decode(list(x.ravel()))


def test_c4_offline_without_shards_says_what_to_download(tmp_path, monkeypatch):
    monkeypatch.setenv("MECEFO_CACHE", str(tmp_path / "cache"))
    with pytest.raises(UsageError, match="c4-train.*json.gz.*--data_dir"):
        TokenData(DataConfig(dataset="c4", data_dir=str(tmp_path)))


def test_c4_stream_failure_is_a_usage_error(monkeypatch):
    def refuse(*a, **k):
        raise ConnectionError("no network")

    import sys
    import types

    monkeypatch.setitem(sys.modules, "datasets", types.SimpleNamespace(load_dataset=refuse))
    with pytest.raises(UsageError, match="cannot stream allenai/c4.*--data_dir"):
        next(data_mod.c4_documents("train", ""))
