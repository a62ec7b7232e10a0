import json
import math
import random
from pathlib import Path

import numpy as np
import pytest
import torch

import griffin.data.dataset as dataset_module
from griffin.data.dataset import load_dataset_tokenizer, load_meta, prepare
from griffin.data.loader import PackedLoader, eval_batches, unigram_loss
from griffin.data.sources import iter_documents
from griffin.data.tokenizer import train_bpe

WORDS = "the griffin hawk gated linear recurrence local attention token window état 日本 🙂 λ".split()


def random_docs(n: int, seed: int = 0, max_words: int = 40) -> list[str]:
    """Documents of 1 to ``max_words`` words (a few of them one character long)."""
    rng = random.Random(seed)
    docs = [" ".join(rng.choice(WORDS) for _ in range(rng.randint(1, max_words))) for _ in range(n)]
    docs[::7] = [rng.choice("abc") for _ in docs[::7]]
    return docs


def write_corpus(directory: Path, docs: list[str]) -> Path:
    directory.mkdir(parents=True, exist_ok=True)
    for i, doc in enumerate(docs):
        (directory / f"doc{i:04d}.txt").write_text(doc, encoding="utf-8")
    return directory


def split_stream(data_dir: Path, split: str) -> tuple[np.ndarray, np.ndarray]:
    """A split's whole token stream and global document starts, read directly from the files."""
    meta = load_meta(data_dir)
    tokens, starts, offset = [np.zeros(0, np.int64)], [np.zeros(0, np.int64)], 0
    for shard in meta["splits"][split]["shards"]:
        t = np.fromfile(data_dir / shard, dtype=np.dtype(meta["dtype"]).newbyteorder("<")).astype(np.int64)
        starts.append(np.load(data_dir / shard.replace(".bin", ".idx.npy"), allow_pickle=False) + offset)
        tokens.append(t)
        offset += len(t)
    return np.concatenate(tokens), np.concatenate(starts)


def split_documents(data_dir: Path, split: str) -> list[np.ndarray]:
    tokens, starts = split_stream(data_dir, split)
    return np.split(tokens, starts[1:]) if len(tokens) else []


@pytest.fixture(scope="module")
def corpus(tmp_path_factory) -> tuple[Path, list[str]]:
    docs = random_docs(60)
    return write_corpus(tmp_path_factory.mktemp("corpus"), docs), docs


@pytest.fixture(scope="module")
def dataset(tmp_path_factory, corpus) -> Path:
    """Byte-level dataset with small shards, so documents continue across shard boundaries."""
    out = tmp_path_factory.mktemp("ds") / "bytes"
    prepare([corpus[0]], out, val_fraction=0.2, shard_tokens=500, progress=False)
    return out


# ---------------------------------------------------------------------------------------------------------------------
# prepare


def test_prepare_bytes(corpus, dataset):
    meta = load_meta(dataset)
    docs = corpus[1]
    assert meta["tokenizer"] == "bytes" and meta["vocab_size"] == 256 and meta["dtype"] == "uint16"
    assert meta["bos_id"] is None and meta["eos_id"] is None and meta["seed"] == 0 and meta["val_fraction"] == 0.2
    assert meta["sources"] == [str(corpus[0])] and "python" not in meta
    assert json.loads((dataset / "meta.json").read_text()) == meta
    train, val = meta["splits"]["train"], meta["splits"]["val"]
    assert val["documents"] == round(0.2 * len(docs)) and train["documents"] + val["documents"] == len(docs)
    total = sum(len(d.encode()) for d in docs)
    assert train["tokens"] + val["tokens"] == total
    # shards of exactly shard_tokens tokens but the last, documents continue into the next shard
    sizes = [(dataset / s).stat().st_size // 2 for s in train["shards"]]
    assert len(sizes) > 2 and sizes[:-1] == [500] * (len(sizes) - 1) and sum(sizes) == train["tokens"]
    idx = np.load(dataset / train["shards"][1].replace(".bin", ".idx.npy"), allow_pickle=False)
    assert idx.dtype == np.int64 and np.all(np.diff(idx) > 0)
    # every document is in exactly one split, unchanged
    texts = [bytes(d.astype(np.uint8)).decode() for split in ("train", "val") for d in split_documents(dataset, split)]
    assert sorted(texts) == sorted(docs)
    # val: the first round(n * val_fraction) of a permutation seeded by `seed`; corpus order within a split
    val_ids = set(np.random.default_rng(0).permutation(len(docs))[: val["documents"]].tolist())
    for split, expected in (("train", [d for i, d in enumerate(docs) if i not in val_ids]),
                            ("val", [d for i, d in enumerate(docs) if i in val_ids])):
        assert [bytes(d.astype(np.uint8)).decode() for d in split_documents(dataset, split)] == expected


def test_prepare_val_assignment_is_seeded(corpus, tmp_path):
    def val_docs(seed: int, name: str, **kw) -> list[str]:
        prepare([corpus[0]], tmp_path / name, seed=seed, progress=False, overwrite=True, **kw)  # "a" twice
        return [bytes(d.astype(np.uint8)).decode() for d in split_documents(tmp_path / name, "val")]

    assert val_docs(1, "a", val_fraction=0.1) == val_docs(1, "b", val_fraction=0.1)
    assert val_docs(1, "a", val_fraction=0.1) != val_docs(2, "c", val_fraction=0.1)
    assert len(val_docs(0, "d", val_fraction=0.001)) == 1  # at least one val document
    assert val_docs(0, "e", val_fraction=0.0) == []
    write_corpus(tmp_path / "two", ["one document", "another one"])
    prepare([tmp_path / "two"], tmp_path / "f", val_fraction=0.9, progress=False)
    assert load_meta(tmp_path / "f")["splits"]["train"]["documents"] == 1  # never all of them


def test_prepare_bpe_jsonl(tmp_path):
    docs = random_docs(40, seed=1)
    jsonl = tmp_path / "corpus.jsonl"
    jsonl.write_text("".join(json.dumps({"content": d, "id": i}) + "\n" for i, d in enumerate(docs)))
    tok_path = train_bpe([jsonl], tmp_path / "tok", vocab_size=320, text_field="content")
    meta = prepare([jsonl], tmp_path / "ds", str(tok_path), val_fraction=0.1, text_field="content", progress=False)
    assert meta["tokenizer"] == "tokenizer.json" and (tmp_path / "ds" / "tokenizer.json").exists()
    assert meta["bos_id"] == 0 and meta["eos_id"] == 1 and meta["vocab_size"] <= 320
    tok = load_dataset_tokenizer(tmp_path / "ds")
    encoded = [d for split in ("train", "val") for d in split_documents(tmp_path / "ds", split)]
    assert all(d[0] == 0 and d[-1] == 1 for d in encoded)
    assert sorted(tok.decode(d[1:-1].tolist()) for d in encoded) == sorted(docs)
    assert sum(map(len, encoded)) < sum(len(d.encode()) for d in docs)  # merges apply
    # text that looks like a special token is text, not the control token
    (tmp_path / "eos.txt").write_text("a <eos> b")
    prepare([tmp_path / "eos.txt"], tmp_path / "ds2", tmp_path / "tok", progress=False)
    (doc,) = split_documents(tmp_path / "ds2", "train")
    assert doc.tolist().count(1) == 1 and tok.decode(doc[1:-1].tolist()) == "a <eos> b"


def test_prepare_parquet(tmp_path):
    import pyarrow as pa
    import pyarrow.parquet as pq

    docs = random_docs(30, seed=2)
    pq.write_table(pa.table({"text": docs + [None], "n": list(range(31))}), tmp_path / "corpus.parquet")
    assert list(iter_documents([tmp_path])) == docs
    prepare([tmp_path / "corpus.parquet"], tmp_path / "ds", val_fraction=0.1, progress=False)
    texts = [bytes(d.astype(np.uint8)).decode() for s in ("train", "val") for d in split_documents(tmp_path / "ds", s)]
    assert sorted(texts) == sorted(docs)
    with pytest.raises(ValueError, match="no column 'body'"):
        list(iter_documents([tmp_path / "corpus.parquet"], text_field="body"))


def _wordlevel_tokenizer(path: Path, vocab_size: int) -> Path:
    from tokenizers import Tokenizer, models, pre_tokenizers

    vocab = {f"w{i}": i for i in range(vocab_size - 1)} | {"<unk>": vocab_size - 1}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tok.save(str(path))
    return path


def test_prepare_dtype(tmp_path):
    big = _wordlevel_tokenizer(tmp_path / "big.json", 70_000)
    write_corpus(tmp_path / "corpus", ["w1 w69998 w5", "w70 w2 nope"])
    with pytest.raises(ValueError, match="vocab_size 70000 does not fit in dtype uint16"):
        prepare([tmp_path / "corpus"], tmp_path / "out" / "ds", str(big), dtype="uint16", progress=False)
    assert not (tmp_path / "out").exists()  # nothing written
    with pytest.raises(ValueError, match="not supported"):
        prepare([tmp_path / "corpus"], tmp_path / "out", dtype="int8", progress=False)
    meta = prepare([tmp_path / "corpus"], tmp_path / "ds", str(big), val_fraction=0, progress=False)
    assert meta["dtype"] == "uint32" and meta["tokenizer"] == "big.json" and (tmp_path / "ds" / "big.json").exists()
    assert load_dataset_tokenizer(tmp_path / "ds").vocab_size == 70_000
    assert [d.tolist() for d in split_documents(tmp_path / "ds", "train")] == [[1, 69998, 5], [70, 2, 69999]]


def test_prepare_errors(tmp_path):
    with pytest.raises(FileNotFoundError, match="missing.txt"):
        prepare([tmp_path / "missing.txt"], tmp_path / "ds", progress=False)
    (tmp_path / "empty").mkdir()
    (tmp_path / "empty" / "a.txt").write_text("")
    with pytest.raises(ValueError, match="no documents.*empty"):
        prepare([tmp_path / "empty"], tmp_path / "ds", progress=False)
    with pytest.raises(ValueError, match="val_fraction"):
        prepare([tmp_path / "empty"], tmp_path / "ds", val_fraction=1.0, progress=False)
    assert not (tmp_path / "ds").exists()
    (tmp_path / "tiny.txt").write_text("0123456789")
    prepare([tmp_path / "tiny.txt"], tmp_path / "ds", progress=False)
    with pytest.raises(ValueError, match=r"has 10 tokens; seq_len 16 needs at least 17"):
        PackedLoader(tmp_path / "ds", "train", 16, 1)
    with pytest.raises(ValueError, match=r"has 10 tokens, 3 windows.*world_size 4 needs at least 13"):
        PackedLoader(tmp_path / "ds", "train", 3, 1, world_size=4)
    with pytest.raises(ValueError, match="has 0 tokens"):
        PackedLoader(tmp_path / "ds", "val", 3, 1)  # a single document all goes to train
    with pytest.raises(FileNotFoundError, match="griffin prepare"):
        PackedLoader(tmp_path / "nothing", "train", 3, 1)


def test_prepare_is_atomic(corpus, tmp_path, monkeypatch):
    out = tmp_path / "ds"
    batched = dataset_module._batched

    def failing(docs, **kw):
        for i, batch in enumerate(batched(docs, max_docs=8)):
            if i == 3:
                raise RuntimeError("disk full")
            yield batch

    monkeypatch.setattr(dataset_module, "_batched", failing)
    with pytest.raises(RuntimeError, match="disk full"):
        prepare([corpus[0]], out, shard_tokens=100, progress=False)
    assert list(tmp_path.iterdir()) == []  # no partial dataset, no temporary directory
    monkeypatch.setattr(dataset_module, "_batched", batched)
    first = prepare([corpus[0]], out, seed=1, progress=False)
    monkeypatch.setattr(dataset_module, "_batched", failing)
    with pytest.raises(RuntimeError, match="disk full"):
        prepare([corpus[0]], out, seed=2, progress=False, overwrite=True)
    assert load_meta(out) == first and [p.name for p in tmp_path.iterdir()] == ["ds"]  # the old dataset is intact
    monkeypatch.setattr(dataset_module, "_batched", batched)
    assert prepare([corpus[0]], out, seed=2, progress=False, overwrite=True)["seed"] == 2  # replaced when complete
    assert [p.name for p in tmp_path.iterdir()] == ["ds"]
    (tmp_path / "mine").mkdir()
    (tmp_path / "mine" / "notes.txt").write_text("keep me")
    with pytest.raises(FileExistsError, match="not a prepared dataset"):
        prepare([corpus[0]], tmp_path / "mine", progress=False)
    assert (tmp_path / "mine" / "notes.txt").read_text() == "keep me"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["ds", "mine"]


# ---------------------------------------------------------------------------------------------------------------------
# PackedLoader


def take(loader: PackedLoader, n: int) -> list:
    return [next(loader) for _ in range(n)]


def assert_batches_equal(a: list, b: list) -> None:
    assert len(a) == len(b)
    for x, y in zip(a, b, strict=True):
        for u, v in zip(x, y, strict=True):
            assert torch.equal(u, v)


def test_loader_is_seeded(dataset):
    a = take(PackedLoader(dataset, "train", 32, 4, seed=3), 5)
    assert_batches_equal(a, take(PackedLoader(dataset, "train", 32, 4, seed=3), 5))
    b = take(PackedLoader(dataset, "train", 32, 4, seed=4), 5)
    assert not all(torch.equal(x.input_ids, y.input_ids) for x, y in zip(a, b, strict=True))
    assert all(x.input_ids.dtype == x.positions.dtype == x.targets.dtype == torch.int64 for x in a)
    assert a[0].input_ids.shape == a[0].positions.shape == a[0].targets.shape == (4, 32)


def test_loader_resumes_exactly(dataset):
    def make() -> PackedLoader:
        return PackedLoader(dataset, "train", 24, 7, seed=7)

    per_epoch = make().num_windows / 7
    assert per_epoch != int(per_epoch)  # some batch spans two epochs
    reference = take(make(), 3 * math.ceil(per_epoch) + 2)
    for k in (0, 3, math.floor(per_epoch), math.ceil(per_epoch), 2 * math.ceil(per_epoch) + 1):
        first = make()
        take(first, k)
        state = json.loads(json.dumps(first.state_dict()))
        resumed = make()
        resumed.load_state_dict(state)
        assert resumed.epoch == pytest.approx(first.epoch) == pytest.approx(k * 7 / make().num_windows)
        assert_batches_equal(take(resumed, 4), reference[k : k + 4])


def test_loader_state_mismatch(dataset, tmp_path, corpus):
    state = PackedLoader(dataset, "train", 24, 5, seed=7).state_dict()
    for kw, name in ((dict(seq_len=25, batch_size=5, seed=7), "seq_len"), (dict(seq_len=24, batch_size=4, seed=7),
                     "batch_size"), (dict(seq_len=24, batch_size=5, seed=8), "seed")):
        with pytest.raises(ValueError, match=name):
            PackedLoader(dataset, "train", **kw).load_state_dict(state)
    prepare([corpus[0]], tmp_path / "other", val_fraction=0.3, progress=False)
    with pytest.raises(ValueError, match="dataset"):
        PackedLoader(tmp_path / "other", "train", 24, 5, seed=7).load_state_dict(state)


def test_loader_packing(dataset):
    """Every window once per epoch, and its inputs, positions and targets against the token stream."""
    tokens, starts = split_stream(dataset, "train")
    seq_len, batch_size = 16, 8
    loader = PackedLoader(dataset, "train", seq_len, batch_size, seed=1)
    windows = PackedLoader(dataset, "train", seq_len, batch_size, seed=1)
    n = loader.num_windows
    assert n == (len(tokens) - 1) // seq_len and loader.tokens_per_epoch == n * seq_len
    doc_of = np.searchsorted(starts, np.arange(len(tokens)), side="right") - 1
    position = np.arange(len(tokens)) - starts[doc_of]
    is_start = np.zeros(len(tokens) + 1, bool)
    is_start[starts] = True
    order = []
    for _ in range(2 * math.ceil(n / batch_size)):
        batch, w = next(loader), windows.next_windows()
        order += w.tolist()
        t = w[:, None] * seq_len + np.arange(seq_len)
        assert np.array_equal(batch.input_ids.numpy(), tokens[t])
        assert np.array_equal(batch.positions.numpy(), position[t])
        assert np.array_equal(batch.targets.numpy(), np.where(is_start[t + 1], -100, tokens[t + 1]))
        # position 0 exactly at the document starts of the idx files, -100 exactly before them
        assert np.array_equal(batch.positions.numpy() == 0, is_start[t])
        assert np.array_equal(batch.targets.numpy() == -100, is_start[t + 1])
    assert sorted(order[:n]) == list(range(n)) and sorted(order[n : 2 * n]) == list(range(n))
    assert order[:n] != order[n : 2 * n] != list(range(n))  # reshuffled every epoch
    assert loader.epoch == pytest.approx(len(order) / n)
    # a window starting mid-document counts on from the document's true position
    assert any(p[0] > 0 for p in PackedLoader(dataset, "train", seq_len, n, shuffle=False).__next__().positions)
    inorder = PackedLoader(dataset, "train", seq_len, 5, shuffle=False)
    assert np.concatenate([inorder.next_windows() for _ in range(3)]).tolist() == list(range(15))


def test_loader_ranks_partition_windows(dataset):
    world = 3
    loaders = [PackedLoader(dataset, "train", 16, 4, seed=5, rank=r, world_size=world) for r in range(world)]
    per_rank = loaders[0].num_windows // world
    epochs = [np.concatenate([ld.next_windows() for _ in range(math.ceil(per_rank / 4))])[:per_rank] for ld in loaders]
    assert all(len(e) == per_rank for e in epochs)
    union = np.concatenate(epochs)
    assert len(set(union.tolist())) == world * per_rank  # disjoint
    full = np.random.default_rng([5, 0]).permutation(loaders[0].num_windows)[: world * per_rank]
    assert np.array_equal(np.sort(union), np.sort(full))
    for r in range(world):
        assert np.array_equal(epochs[r], full[r::world])
    states = [ld.state_dict() for ld in loaders]
    assert states[0] == states[1] == states[2]  # one rank's state resumes them all
    with pytest.raises(ValueError, match="rank 3"):
        PackedLoader(dataset, "train", 16, 4, rank=3, world_size=3)


def test_eval_batches(dataset):
    loader = PackedLoader(dataset, "val", 8, 4, shuffle=False)
    batches = eval_batches(dataset, "val", 8, 4)
    assert len(batches) == math.ceil(loader.num_windows / 4) and len(batches[-1].input_ids) < 4
    assert sum(len(b.input_ids) for b in batches) == loader.num_windows  # the last batch may be smaller
    assert_batches_equal(batches[:2], take(loader, 2))
    assert_batches_equal(eval_batches(dataset, "val", 8, 4, max_batches=2), batches[:2])


def test_unigram_loss(dataset):
    vocab = load_meta(dataset)["vocab_size"]
    train, train_starts = split_stream(dataset, "train")
    val, val_starts = split_stream(dataset, "val")
    counts = np.bincount(np.delete(train, train_starts), minlength=vocab)
    p = (counts + 1) / (counts.sum() + vocab)
    expected = -np.mean(np.log(p[np.delete(val, val_starts)]))
    assert unigram_loss(dataset) == pytest.approx(expected, rel=1e-12)
    assert 0 < expected < math.log(vocab)


def test_a_single_text_file_becomes_documents_with_a_validation_split(tmp_path):
    """nanoGPT's workflow: one text file. It is cut into pieces so that the validation split holds some."""
    text = "\n\n".join(f"Verse {i}: " + "the griffin flies over the hawk. " * 30 for i in range(200))
    (tmp_path / "input.txt").write_text(text)
    meta = prepare([tmp_path / "input.txt"], tmp_path / "data", progress=False)
    splits = meta["splits"]
    assert meta["piece_chars"] == len(text) // 50  # short: at least 50 pieces
    assert splits["val"]["documents"] == 1 and splits["train"]["documents"] >= 49
    assert splits["train"]["tokens"] + splits["val"]["tokens"] == len(text.encode())
    whole = prepare([tmp_path / "input.txt"], tmp_path / "whole", progress=False, piece_chars=0)
    assert whole["splits"]["val"]["documents"] == 0  # asked not to cut: one document, no validation split


def test_a_long_or_tiny_text_file_is_cut_into_bounded_pieces(tmp_path):
    from griffin.data.dataset import MIN_PIECE_CHARS, PIECE_CHARS

    long = "\n".join(f"line {i} of a long book" for i in range(60_000))  # ~1.4M characters
    (tmp_path / "long.txt").write_text(long)
    meta = prepare([tmp_path / "long.txt"], tmp_path / "long", progress=False)
    assert meta["piece_chars"] == PIECE_CHARS and meta["splits"]["val"]["documents"] >= 2
    (tmp_path / "tiny.txt").write_text("a few words\n" * 100)  # 1,200 characters: pieces of the minimum size
    meta = prepare([tmp_path / "tiny.txt"], tmp_path / "tiny", progress=False)
    assert meta["piece_chars"] == MIN_PIECE_CHARS and meta["splits"]["val"]["documents"] == 1

