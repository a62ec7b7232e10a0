"""Fine-tuning data (griffin.data.examples): which tokens carry loss, packing whole examples with document resets, the
example loader, and bad JSONL input."""

from __future__ import annotations

import json
import re
from collections import Counter
from pathlib import Path

import numpy as np
import pytest
import torch

from griffin import CausalLM, ModelConfig
from griffin.data.chat import ChatTemplate
from griffin.data.examples import (
    ExampleEncoder,
    ExampleLoader,
    ExampleSplit,
    example_eval_batches,
    examples_unigram_loss,
    pack,
    packed_batch,
    prepare_examples,
    read_records,
    record_kind,
)
from griffin.data.tokenizer import ByteTokenizer, load_tokenizer, train_bpe
from griffin.io import OutputExistsError
from griffin.ops.cross_entropy import IGNORE_INDEX
from tests.conftest import perturb_, seed_torch

# Gemma's chat template, abridged: no system role, the assistant is "model", and the generation prompt is the header
# "<start_of_turn>model\n".
GEMMA_TEMPLATE = (
    "{{ bos_token }}{% for message in messages %}"
    "{% if message['role'] == 'system' %}{{ raise_exception('System role not supported') }}{% endif %}"
    "{% set role = 'model' if message['role'] == 'assistant' else message['role'] %}"
    "{{ '<start_of_turn>' + role + '\\n' + message['content'] + '<end_of_turn>\\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<start_of_turn>model\\n' }}{% endif %}"
)

CHAT = [
    {"role": "system", "content": "Answer briefly."},
    {"role": "user", "content": "Which bird?"},
    {"role": "assistant", "content": "The hawk — fast, 日本 🙂."},
    {"role": "user", "content": [{"type": "text", "text": "And the "}, {"type": "text", "text": "other one?"}]},
    {"role": "assistant", "content": "A griffin: half eagle."},
]


def text_of(content) -> str:
    return content if isinstance(content, str) else "".join(part["text"] for part in content)


def plain_pieces(messages) -> list[tuple[str, bool]]:
    """The plain template's rendering of a chat, written out by hand: (text, is a target) pieces."""
    pieces = []
    for m in messages:
        if m["role"] == "assistant":
            pieces += [("<|assistant|>\n", False), (text_of(m["content"]) + "<|end|>\n", True)]
        else:
            pieces.append((f"<|{m['role']}|>\n{text_of(m['content'])}<|end|>\n", False))
    return pieces


def gemma_pieces(messages) -> list[tuple[str, bool]]:
    pieces = []
    for m in messages:
        if m["role"] == "assistant":
            pieces += [("<start_of_turn>model\n", False), (text_of(m["content"]) + "<end_of_turn>\n", True)]
        else:
            pieces.append((f"<start_of_turn>{m['role']}\n{text_of(m['content'])}<end_of_turn>\n", False))
    return pieces


def byte_expectation(pieces: list[tuple[str, bool]]) -> tuple[list[int], list[bool]]:
    """Byte-level ids and the per-token target mask of the pieces, position by position."""
    ids, mask = [], []
    for text, target in pieces:
        data = text.encode("utf-8")
        ids += list(data)
        mask += [target] * len(data)
    return ids, mask


def merged(pieces: list[tuple[str, bool]]) -> list[tuple[bool, str]]:
    """Consecutive pieces of the same kind joined: the maximal runs of targets and non-targets."""
    out: list[tuple[bool, str]] = []
    for text, target in pieces:
        if out and out[-1][0] == target:
            out[-1] = (target, out[-1][1] + text)
        else:
            out.append((target, text))
    return out


def runs(tokenizer, ids, mask) -> list[tuple[bool, str]]:
    """The maximal runs of targets and non-targets of a tokenized example, each decoded on its own."""
    out, start = [], 0
    for j in range(1, len(ids) + 1):
        if j == len(ids) or mask[j] != mask[start]:
            out.append((bool(mask[start]), tokenizer.decode(list(ids[start:j]))))
            start = j
    return out


def write_jsonl(path: Path, lines) -> Path:
    """One line per item: a dict is written as JSON, a string as it is."""
    path.write_text("".join((ln if isinstance(ln, str) else json.dumps(ln, ensure_ascii=False)) + "\n"
                            for ln in lines), encoding="utf-8")
    return path


def shifted_targets(tokens, mask) -> torch.Tensor:
    """Next-token targets of one example alone: token j+1 at j where it is a target, else IGNORE_INDEX."""
    t = [int(tokens[j + 1]) if mask[j + 1] else IGNORE_INDEX for j in range(len(tokens) - 1)]
    return torch.tensor(t + [IGNORE_INDEX])


@pytest.fixture(scope="module")
def bpe(tmp_path_factory):
    """A small byte-level BPE with <bos> and <eos>, trained on text like the examples'."""
    root = tmp_path_factory.mktemp("bpe")
    corpus = root / "corpus.txt"
    lines = [f"<|user|>\nthe hawk and the griffin {i}<|end|>\n<|assistant|>\nhalf eagle, fast hawk<|end|>\n"
             for i in range(40)]
    corpus.write_text("".join(lines), encoding="utf-8")
    path = train_bpe([corpus], root / "tokenizer.json", vocab_size=320)
    tok = load_tokenizer(path)
    assert tok.bos_id is not None and tok.eos_id is not None
    return path, tok


# ---------------------------------------------------------------------------------------------------------------------
# 1. Only the response tokens carry loss


def test_plain_chat_targets_are_the_replies_position_by_position():
    tok = ByteTokenizer()
    example = ExampleEncoder(tok, ChatTemplate(tok))(dict(messages=CHAT), "chat.jsonl:1")
    ids, mask = byte_expectation(plain_pieces(CHAT))
    assert example.ids == ids
    assert example.mask == mask
    assert example.where == "chat.jsonl:1"
    # the prompt is everything before the last reply: the whole chat but it, generation prompt included
    last = b"A griffin: half eagle.<|end|>\n"
    assert example.prompt == len(ids) - len(last)
    assert bytes(ids[example.prompt:]) == last
    targets = bytes(i for i, m in zip(ids, mask, strict=True) if m).decode()
    assert targets == "The hawk — fast, 日本 🙂.<|end|>\nA griffin: half eagle.<|end|>\n"


def test_plain_chat_with_bpe_tokens_runs_of_targets(bpe):
    _, tok = bpe
    example = ExampleEncoder(tok, ChatTemplate(tok))(dict(messages=CHAT), "x:1")
    assert example.ids[0] == tok.bos_id and not example.mask[0]
    got = runs(tok, example.ids[1:], example.mask[1:])
    assert got == merged(plain_pieces(CHAT))
    # the rendering as one piece of text is what the pieces make
    assert tok.decode(example.ids[1:]) == "".join(text for text, _ in plain_pieces(CHAT))


def test_gemma_template_header_carries_no_loss():
    tok = ByteTokenizer()
    messages = [m for m in CHAT if m["role"] != "system"]
    example = ExampleEncoder(tok, ChatTemplate(tok, GEMMA_TEMPLATE))(dict(messages=messages), "g:1")
    ids, mask = byte_expectation(gemma_pieces(messages))
    assert example.ids == ids
    assert example.mask == mask
    header = b"<start_of_turn>model\n"
    raw = bytes(ids)
    starts = [m.start() for m in re.finditer(re.escape(header), raw)]
    assert len(starts) == 2
    for s in starts:
        assert not any(example.mask[s:s + len(header)])
        assert example.mask[s + len(header)]  # the reply starts right after the header
    targets = bytes(i for i, m in zip(ids, example.mask, strict=True) if m).decode()
    assert targets == "The hawk — fast, 日本 🙂.<end_of_turn>\nA griffin: half eagle.<end_of_turn>\n"


def test_prompt_completion_trains_the_completion_and_eos(bpe):
    _, tok = bpe
    prompt, completion = "Which bird is fast?", " The hawk."
    example = ExampleEncoder(tok, None)({"prompt": prompt, "completion": completion}, "p:1")
    p, c = tok.encode(prompt), tok.encode(completion)
    assert example.ids == [tok.bos_id] + p + c + [tok.eos_id]
    assert example.mask == [False] * (1 + len(p)) + [True] * (len(c) + 1)
    assert example.prompt == 1 + len(p)


def test_prompt_completion_without_special_tokens_never_targets_the_first_token():
    tok = ByteTokenizer()
    example = ExampleEncoder(tok, None)({"prompt": "", "completion": "ab"}, "p:1")
    assert example.ids == [ord("a"), ord("b")] and example.mask == [False, True]
    example = ExampleEncoder(tok, None)({"prompt": "q", "completion": "ab"}, "p:1")
    assert example.mask == [False, True, True] and example.prompt == 1


def test_text_trains_everything_but_the_first_token(bpe):
    _, tok = bpe
    text = "the hawk and the griffin"
    example = ExampleEncoder(tok, None)({"text": text, "meta": {"ignored": 1}}, "t:1")
    assert example.ids == [tok.bos_id] + tok.encode(text) + [tok.eos_id]
    assert example.mask == [False] + [True] * (len(example.ids) - 1)
    assert example.prompt == 0


@pytest.mark.parametrize("record", [dict(messages=CHAT), {"prompt": "Which?", "completion": " The hawk."}])
def test_loss_on_all_trains_every_token(bpe, record):
    _, tok = bpe
    response = ExampleEncoder(tok, ChatTemplate(tok), "response")(record, "a:1")
    everything = ExampleEncoder(tok, ChatTemplate(tok), "all")(record, "a:1")
    assert everything.ids == response.ids
    assert everything.mask == [False] + [True] * (len(response.ids) - 1)
    assert not all(response.mask[1:])  # it does change something
    assert everything.prompt == 0
    with pytest.raises(ValueError, match="loss_on='some'"):
        ExampleEncoder(tok, None, "some")


def test_packed_batch_targets_follow_the_masks(tmp_path, bpe):
    """Through prepare_examples and packed_batch: the target at position j is token j+1 exactly where token j+1 is a
    target; an example's last token predicts nothing (not the next example's first); padding is inert."""
    path, tok = bpe
    records = [dict(messages=CHAT), {"prompt": "Which?", "completion": " The hawk."}, {"text": "half eagle"},
               dict(messages=CHAT[1:3]), {"prompt": "Q", "completion": "A"}]
    src = write_jsonl(tmp_path / "ex.jsonl", records)
    out = tmp_path / "ds"
    prepare_examples([src], out, path, "plain", seq_len=128, val_fraction=0)
    encode = ExampleEncoder(tok, ChatTemplate(tok))
    expected = [encode(r, f"{src}:{i + 1}") for i, r in enumerate(records)]
    split = ExampleSplit(out, "train")
    assert len(split) == len(records)
    for i, e in enumerate(expected):
        tokens, mask = split.example(i)
        assert tokens.tolist() == e.ids and mask.tolist() == e.mask

    seq_len = 128
    order = np.array([3, 0, 4, 2, 1])
    rows = pack(split.lengths, order, seq_len)
    assert [i for row in rows for i in row] == order.tolist()
    assert all(sum(split.lengths[row]) <= seq_len for row in rows) and len(rows) >= 2
    batch = packed_batch(split, rows, seq_len)
    assert batch.input_ids.shape == batch.positions.shape == batch.targets.shape == (len(rows), seq_len)
    for r, row in enumerate(rows):
        at = 0
        for i in row:
            ids, mask = expected[i].ids, expected[i].mask
            n = len(ids)
            assert batch.input_ids[r, at:at + n].tolist() == ids
            assert batch.positions[r, at:at + n].tolist() == list(range(n))
            for j in range(n):
                target = int(batch.targets[r, at + j])
                if j + 1 < n and mask[j + 1]:
                    assert target == ids[j + 1], (r, i, j)
                else:
                    assert target == IGNORE_INDEX, (r, i, j)
            at += n
        assert (batch.positions[r, at:] == -1).all()
        assert (batch.input_ids[r, at:] == 0).all()
        assert (batch.targets[r, at:] == IGNORE_INDEX).all()
    # End to end: the tokens a chat's row trains on are the replies' text and <|end|>\n, nothing else.
    r = next(r for r, row in enumerate(rows) if 0 in row)
    at = sum(len(expected[i].ids) for i in rows[r][: list(rows[r]).index(0)])
    seg = batch.targets[r, at:at + len(expected[0].ids)]
    trained = seg[seg != IGNORE_INDEX].tolist()
    assert tok.decode(trained) == "".join(text_of(m["content"]) + "<|end|>\n" for m in CHAT if m["role"] == "assistant")


# ---------------------------------------------------------------------------------------------------------------------
# 2. A packed row gives the loss and gradients of its examples alone


RECORDS_FOR_MODEL = [
    {"prompt": "abc", "completion": "defgh"},  # 8 tokens
    {"text": "the hawk flies fast"},  # 19, longer than the attention window
    {"prompt": "x", "completion": "yz!"},  # 4
]


def model_split(tmp_path: Path, seq_len: int) -> ExampleSplit:
    src = write_jsonl(tmp_path / "m.jsonl", RECORDS_FOR_MODEL)
    prepare_examples([src], tmp_path / "m", ByteTokenizer(), None, seq_len=seq_len, val_fraction=0)
    return ExampleSplit(tmp_path / "m", "train")


def losses_and_grads(model, split, seq_len):
    """(packed loss, packed grads), (summed loss alone, summed grads alone)."""
    row = np.arange(len(split))
    batch = packed_batch(split, [row], seq_len)
    assert (batch.positions[0, -1] == -1) and (batch.positions == 0).sum() == len(split)  # padding at the end
    model.zero_grad()
    packed = model(batch.input_ids, batch.positions, targets=batch.targets)
    packed.backward()
    packed_grads = {n: p.grad.clone() for n, p in model.named_parameters()}
    model.zero_grad()
    alone = torch.zeros((), dtype=torch.float64)
    for i in row:
        tokens, mask = split.example(int(i))
        loss = model(torch.from_numpy(tokens)[None], targets=shifted_targets(tokens, mask)[None])
        loss.backward()
        alone = alone + loss.detach()
    alone_grads = {n: p.grad.clone() for n, p in model.named_parameters()}
    return (packed.detach(), packed_grads), (alone, alone_grads)


def griffin_model(gen, **changes) -> CausalLM:
    seed_torch(gen)
    cfg = ModelConfig.from_preset("griffin-tiny", vocab_size=256, **changes)
    assert {"recurrent", "local_attention"} <= set(cfg.block_types) and cfg.attention_window < 19
    model = CausalLM(cfg).double()
    perturb_(model, gen)
    return model


def test_packed_examples_give_the_loss_and_gradients_of_each_alone(tmp_path, gen):
    seq_len = 36  # 31 tokens of examples, 5 of padding
    split = model_split(tmp_path, seq_len)
    assert split.lengths.tolist() == [8, 19, 4]
    model = griffin_model(gen, conv1d_document_reset=True)
    (packed, packed_grads), (alone, alone_grads) = losses_and_grads(model, split, seq_len)
    assert packed > 0
    torch.testing.assert_close(packed, alone, rtol=1e-12, atol=0)
    for name, grad in packed_grads.items():
        assert grad.abs().max() > 0, name  # no comparison of zeros
        torch.testing.assert_close(grad, alone_grads[name], rtol=1e-9, atol=1e-12, msg=name)


@pytest.mark.parametrize("leak", [{"conv1d_document_reset": False}, {"attention_document_mask": False}])
def test_without_document_resets_the_packed_loss_differs(tmp_path, gen, leak):
    """The check above can fail: a model whose Conv1D (or attention) sees the previous example of its row."""
    seq_len = 36
    split = model_split(tmp_path, seq_len)
    model = griffin_model(gen, **leak)
    (packed, _), (alone, _) = losses_and_grads(model, split, seq_len)
    assert abs(float(packed - alone)) > 1e-6 * float(alone)


# ---------------------------------------------------------------------------------------------------------------------
# 3. ExampleLoader


def loader_dataset(tmp_path: Path, n: int = 30) -> Path:
    """``n`` text examples of distinct contents and 3 to 22 bytes; a tenth held out."""
    rng = np.random.default_rng(0)
    records = [{"text": f"{i:02d}" + "".join(rng.choice(list("ab c"), int(rng.integers(1, 21))))} for i in range(n)]
    src = write_jsonl(tmp_path / "l.jsonl", records)
    out = tmp_path / "l"
    prepare_examples([src], out, ByteTokenizer(), None, seq_len=32, val_fraction=0.1)
    return out


def row_examples(split: ExampleSplit, batch) -> list[tuple[int, ...]]:
    """The example indices of each row of a batch, found by their tokens; checks that every example is whole, in
    positions 0..n-1, with its own targets, and that the rest of the row is padding."""
    index = {tuple(split.example(i)[0].tolist()): i for i in range(len(split))}
    assert len(index) == len(split)
    out = []
    for r in range(batch.input_ids.shape[0]):
        pos, ids, tgt = batch.positions[r], batch.input_ids[r], batch.targets[r]
        starts = (pos == 0).nonzero().flatten().tolist()
        end = int((pos >= 0).sum())
        assert (pos[end:] == -1).all() and (pos[:end] >= 0).all()
        found = []
        for a, b in zip(starts, starts[1:] + [end], strict=True):
            i = index[tuple(ids[a:b].tolist())]  # a KeyError: a split or foreign example
            tokens, mask = split.example(i)
            assert pos[a:b].tolist() == list(range(b - a))
            assert tgt[a:b].tolist() == shifted_targets(tokens, mask).tolist()
            found.append(i)
        out.append(tuple(found))
    return out


def epoch_rows(loader: ExampleLoader, split: ExampleSplit) -> list[tuple[int, ...]]:
    """The rows of one epoch of a loader of batch size 1."""
    assert loader.batch_size == 1
    start = loader.epoch
    rows = [row_examples(split, next(loader))[0] for _ in range(loader.windows_per_rank)]
    assert loader.epoch == start + 1
    return rows


def test_loader_epoch_holds_each_train_example_once_whole(tmp_path):
    data = loader_dataset(tmp_path)
    split = ExampleSplit(data, "train")
    assert len(split) == 27
    loader = ExampleLoader(data, "train", seq_len=32, batch_size=1, seed=3)
    first, second = epoch_rows(loader, split), epoch_rows(loader, split)
    for rows in (first, second):
        assert sorted(i for row in rows for i in row) == list(range(len(split)))
        assert all(sum(int(split.lengths[i]) for i in row) <= 32 for row in rows)
    assert first != second  # shuffled anew each epoch
    assert Counter(map(len, first)) != Counter({1: len(first)})  # rows do hold several examples
    in_order = ExampleLoader(data, "train", seq_len=32, batch_size=1, shuffle=False)
    a, b = epoch_rows(in_order, split), epoch_rows(in_order, split)
    assert a == b and [i for row in a for i in row] == list(range(len(split)))


def test_loader_resumes_from_its_state(tmp_path):
    data = loader_dataset(tmp_path)
    loader = ExampleLoader(data, "train", seq_len=32, batch_size=2, seed=5)
    for _ in range(3):
        next(loader)
    state = json.loads(json.dumps(loader.state_dict()))  # it survives a checkpoint's JSON
    expected = [next(loader) for _ in range(6)]  # past the end of the epoch
    assert loader.epoch > 1
    resumed = ExampleLoader(data, "train", seq_len=32, batch_size=2, seed=5)
    resumed.load_state_dict(state)
    for want in expected:
        got = next(resumed)
        for a, b in zip(got, want, strict=True):
            assert torch.equal(a, b)
    fresh = ExampleLoader(data, "train", seq_len=32, batch_size=2, seed=5)
    assert not torch.equal(next(fresh).input_ids, expected[0].input_ids)  # resuming is not starting over
    other = ExampleLoader(data, "train", seq_len=32, batch_size=2, seed=6)
    with pytest.raises(ValueError, match="seed: 5 in the state, 6 here"):
        other.load_state_dict(state)


def test_loader_ranks_see_disjoint_rows(tmp_path):
    data = loader_dataset(tmp_path)
    split = ExampleSplit(data, "train")
    whole = epoch_rows(ExampleLoader(data, "train", seq_len=32, batch_size=1, seed=1), split)
    ranks = [epoch_rows(ExampleLoader(data, "train", seq_len=32, batch_size=1, seed=1, rank=r, world_size=2), split)
             for r in range(2)]
    seen = [{i for row in rows for i in row} for rows in ranks]
    assert not seen[0] & seen[1]
    assert len(ranks[0]) == len(ranks[1]) == len(whole) // 2
    assert ranks[0] == whole[0:len(whole) // 2 * 2:2] and ranks[1] == whole[1:len(whole) // 2 * 2:2]


def test_loader_refuses_an_example_longer_than_seq_len(tmp_path):
    data = loader_dataset(tmp_path)
    longest = int(ExampleSplit(data, "train").lengths.max())
    with pytest.raises(ValueError, match=f"example of {longest} tokens, more than seq_len {longest - 1}"):
        ExampleLoader(data, "train", seq_len=longest - 1, batch_size=1)
    ExampleLoader(data, "train", seq_len=longest, batch_size=1)


def test_every_epoch_gives_every_rank_a_row(tmp_path):
    """Packings differ by epoch: with too few tokens an epoch could leave a rank without a row (a silent skip of
    epochs), so too few tokens for the ranks are refused up front; with just enough, every epoch serves every rank."""
    src = write_jsonl(tmp_path / "t.jsonl", [{"text": t} for t in ("abc", "defgh", "ijk", "lmnop")])
    prepare_examples([src], tmp_path / "d", ByteTokenizer(), None, seq_len=8, val_fraction=0)
    with pytest.raises(ValueError, match="holds 16 tokens: at least 17 are needed to give each of the 3"):
        ExampleLoader(tmp_path / "d", "train", 8, 1, seed=0, rank=0, world_size=3)
    loader = ExampleLoader(tmp_path / "d", "train", 8, 1, seed=0, rank=1, world_size=2)
    progress = 0.0
    for _ in range(12):
        assert int((next(loader).targets != -100).sum()) > 0
        assert loader.epoch > progress  # a fraction of an epoch, never a division by an empty epoch
        progress = loader.epoch
    assert loader.state_dict()["epoch"] >= 6  # 1 or 2 rows per rank an epoch: 12 batches end past epoch 6


def test_held_out_examples_given_as_a_file(tmp_path):
    """``val_files``: those examples are the val split, all of ``files`` the train split (no random hold-out)."""
    train = write_jsonl(tmp_path / "train.jsonl", [{"text": f"train {i}"} for i in range(7)])
    val = write_jsonl(tmp_path / "val.jsonl", [{"text": f"val {i}"} for i in range(3)])
    meta = prepare_examples([train], tmp_path / "d", ByteTokenizer(), None, seq_len=16, val_files=[val])
    assert meta["splits"]["train"]["examples"] == 7 and meta["splits"]["val"]["examples"] == 3
    held_out = ExampleSplit(tmp_path / "d", "val")
    assert [bytes(held_out.example(i)[0].tolist()) for i in range(3)] == [b"val 0", b"val 1", b"val 2"]
    empty = write_jsonl(tmp_path / "empty.jsonl", [{"text": "x"}])  # one byte: nothing to predict
    with pytest.raises(ValueError, match="empty.jsonl: no example with a token to evaluate on"):
        prepare_examples([train], tmp_path / "e", ByteTokenizer(), None, seq_len=16, val_files=[empty])


def test_a_byte_order_mark_is_no_json_error(tmp_path):
    path = tmp_path / "bom.jsonl"
    path.write_bytes("\ufeff".encode() + b'{"prompt": "a", "completion": "b"}\n')
    assert [r for _, r in read_records(path)] == [{"prompt": "a", "completion": "b"}]


def test_eval_batches_and_unigram_baseline(tmp_path):
    data = loader_dataset(tmp_path)
    val = ExampleSplit(data, "val")
    assert len(val) == 3
    batches = example_eval_batches(data, "val", seq_len=32, batch_size=2)
    rows = [row for b in batches for row in row_examples(val, b)]
    assert [i for row in rows for i in row] == list(range(len(val)))  # in order, each once
    assert len(example_eval_batches(data, "val", seq_len=16, batch_size=1, max_batches=1)) == 1
    train = ExampleSplit(data, "train")
    counts = np.bincount(np.asarray(train.tokens)[np.asarray(train.mask)], minlength=256) + 1.0
    val_targets = np.asarray(val.tokens)[np.asarray(val.mask)]
    want = -np.log(counts[val_targets] / counts.sum()).mean()
    assert examples_unigram_loss(data) == pytest.approx(want, rel=1e-12)
    src = write_jsonl(tmp_path / "no-val.jsonl", [{"text": "abc"}, {"text": "defg"}])
    prepare_examples([src], tmp_path / "no-val", ByteTokenizer(), None, seq_len=8, val_fraction=0)
    assert example_eval_batches(tmp_path / "no-val", "val", seq_len=8, batch_size=2) == []
    with pytest.raises(ValueError, match="the val split of .* has no targets"):
        examples_unigram_loss(tmp_path / "no-val")


# ---------------------------------------------------------------------------------------------------------------------
# 4. Bad input names the file, the line and the value


GOOD = [{"text": "fine"}, ""]  # line 1 good, line 2 blank: the bad line is line 3


@pytest.mark.parametrize("line, message", [
    ('{"text": "unclosed"', r"not a JSON line: .* \(column \d+\)"),
    ('[{"text": "a"}]', r"expected a JSON object .* got list"),
    ('"just a string"', r"expected a JSON object .* got str"),
    ({"input": "x", "output": "y"}, r"found keys \['input', 'output'\]"),
    ({"text": "a", "prompt": "b", "completion": "c"}, "found keys of completion and text examples"),
    ({"messages": [{"role": "user", "content": "hi"}]}, "the chat has no assistant turn"),
    ({"messages": [{"role": "bot", "content": "hi"}, {"role": "assistant", "content": "yo"}]},
     r"messages\[0\] has the unknown role 'bot'"),
    ({"messages": [{"role": "user"}, {"role": "assistant", "content": "yo"}]},
     r"messages\[0\] must be an object with 'role' and 'content'"),
    ({"messages": []}, "'messages' must be a non-empty list"),
    ({"messages": [{"role": "user", "content": 5}, {"role": "assistant", "content": "yo"}]},
     r"messages\[0\]: message content must be a string or a list of text parts, got int"),
    ({"prompt": "a", "completion": 3}, "'completion' must be a string, got int"),
    ({"completion": "a"}, "'prompt' must be a string, got nothing"),
    ({"text": None}, "'text' must be a string, got NoneType"),
])
def test_bad_line_is_named(tmp_path, line, message):
    src = write_jsonl(tmp_path / "bad.jsonl", [*GOOD, line, {"text": "after"}])
    out = tmp_path / "out"
    with pytest.raises(ValueError, match=re.escape(f"{src}:3: ") + ".*" + message):
        prepare_examples([src], out, ByteTokenizer(), "plain", seq_len=64)
    assert not out.exists()  # nothing written


def test_read_records_and_record_kind_directly(tmp_path):
    src = write_jsonl(tmp_path / "r.jsonl", [{"text": "a"}, "", "  ", {"prompt": "p", "completion": "c"}])
    got = list(read_records(src))
    assert got == [(f"{src}:1", {"text": "a"}), (f"{src}:4", {"prompt": "p", "completion": "c"})]
    assert [record_kind(r, w) for w, r in got] == ["text", "completion"]
    assert record_kind(dict(messages=CHAT), "w") == "chat"


def test_a_chat_without_a_template_is_refused(tmp_path):
    src = write_jsonl(tmp_path / "c.jsonl", [{"text": "fine"}, dict(messages=CHAT)])
    pattern = re.escape(f"{src}:2: a chat needs a chat template") + ".*--chat-template plain"
    with pytest.raises(ValueError, match=pattern):
        prepare_examples([src], tmp_path / "out", ByteTokenizer(), None, seq_len=256)


@pytest.mark.parametrize("template, message", [
    (GEMMA_TEMPLATE, "chat template: System role not supported"),
    # each rendering ends with the message count, so no rendering extends the one before it
    ("{% for m in messages %}{{ m['content'] }}\n{% endfor %}{{ messages | length }}",
     r"the chat template does not render message 1 \(user\) as a continuation .* train on all tokens"),
])
def test_a_template_error_names_the_line(tmp_path, template, message):
    src = write_jsonl(tmp_path / "g.jsonl", [{"text": "fine"}, dict(messages=CHAT)])
    with pytest.raises(ValueError, match=re.escape(f"{src}:2: ") + message):
        prepare_examples([src], tmp_path / "out", ByteTokenizer(), template, seq_len=256)


def test_an_example_longer_than_seq_len_is_refused_or_truncated(tmp_path):
    lines = [{"text": "short"}, {"text": "x" * 20}, {"text": "short too"}, {"text": "y" * 30},
             {"prompt": "p" * 15, "completion": "c"}]
    src = write_jsonl(tmp_path / "long.jsonl", lines)
    out = tmp_path / "out"
    pattern = (re.escape(f"{src}:2: the example has 20 tokens, more than --seq-len 12 ") +
               r"\(3 examples are longer, the longest 30 tokens\).*--truncate")
    with pytest.raises(ValueError, match=pattern):
        prepare_examples([src], out, ByteTokenizer(), None, seq_len=12)
    assert not out.exists()
    meta = prepare_examples([src], out, ByteTokenizer(), None, seq_len=12, truncate=True, val_fraction=0)
    # the pair's completion lies past token 12: left with nothing to train, it is dropped
    assert meta["truncated"] == 3 and meta["dropped"] == 1 and meta["truncate"] is True
    split = ExampleSplit(out, "train")
    got = [bytes(split.example(i)[0].tolist()).decode() for i in range(len(split))]
    assert got == ["short", "x" * 12, "short too", "y" * 12]
    assert split.lengths.max() == 12 and meta["splits"]["train"]["examples"] == 4


def test_a_missing_file_is_named(tmp_path):
    good = write_jsonl(tmp_path / "good.jsonl", [{"text": "fine"}])
    missing = tmp_path / "nope.jsonl"
    with pytest.raises(FileNotFoundError, match=re.escape(str(missing))):
        prepare_examples([good, missing], tmp_path / "out", ByteTokenizer(), None, seq_len=16)


# ---------------------------------------------------------------------------------------------------------------------
# 5. prepare_examples' output


@pytest.mark.parametrize("n, fraction, n_val",
                         [(21, 0.2, 4), (20, 0.13, 3), (10, 0.3, 3), (3, 0.1, 1), (2, 0.01, 1), (5, 0.0, 0)])
def test_prepare_counts_match_the_arrays(tmp_path, n, fraction, n_val):
    records = []
    for i in range(n):
        kind = i % 3
        records.append({"text": f"text {i}"} if kind == 0 else
                       {"prompt": f"q{i}?", "completion": f" a{i}"} if kind == 1 else
                       {"messages": [{"role": "user", "content": f"u{i}"}, {"role": "assistant", "content": f"r{i}"}]})
    src = write_jsonl(tmp_path / "p.jsonl", records)
    out = tmp_path / "ds"
    meta = prepare_examples([src], out, ByteTokenizer(), "plain", seq_len=64, val_fraction=fraction, seed=7)
    assert json.loads((out / "meta.json").read_text()) == meta
    assert meta["format"] == "griffin-examples" and meta["template"] == "plain" and meta["vocab_size"] == 256
    assert meta["splits"]["val"]["examples"] == n_val and meta["splits"]["train"]["examples"] == n - n_val
    encode = ExampleEncoder(ByteTokenizer(), ChatTemplate(ByteTokenizer()))
    want = Counter(tuple(encode(r, "w").ids) for r in records)
    seen: Counter = Counter()
    for split, counts in meta["splits"].items():
        tokens = np.load(out / f"{split}-tokens.npy")
        mask = np.load(out / f"{split}-mask.npy")
        offsets = np.load(out / f"{split}-offsets.npy")
        prompts = np.load(out / f"{split}-prompts.npy")
        assert counts["tokens"] == len(tokens) == len(mask) == offsets[-1]
        assert counts["targets"] == int(mask.sum())
        assert counts["examples"] == len(offsets) - 1 == len(prompts)
        assert offsets[0] == 0 and (np.diff(offsets) > 0).all()
        assert (prompts >= 0).all() and (prompts < np.diff(offsets)).all()
        for a, b in zip(offsets[:-1], offsets[1:], strict=True):
            seen[tuple(tokens[a:b].tolist())] += 1
            assert mask[a:b].any() and not mask[a]
    assert seen == want  # every example in exactly one split
    again = tmp_path / "again"
    prepare_examples([src], again, ByteTokenizer(), "plain", seq_len=64, val_fraction=fraction, seed=7)
    assert np.array_equal(np.load(again / "val-tokens.npy"), np.load(out / "val-tokens.npy"))  # seeded


def test_prepare_refuses_to_overwrite(tmp_path, bpe):
    path, tok = bpe
    src = write_jsonl(tmp_path / "o.jsonl", [{"text": "one"}, {"text": "two"}])
    out = tmp_path / "ds"
    first = prepare_examples([src], out, path, None, seq_len=16, val_fraction=0)
    assert first["tokenizer"] == "tokenizer.json" and (out / "tokenizer.json").is_file()
    assert first["bos_id"] == tok.bos_id and first["eos_id"] == tok.eos_id
    write_jsonl(src, [{"text": "three"}])
    with pytest.raises(OutputExistsError, match=re.escape(str(out)) + ".*--overwrite"):
        prepare_examples([src], out, path, None, seq_len=16, val_fraction=0)
    assert ExampleSplit(out, "train").meta == first and len(ExampleSplit(out, "train")) == 2  # untouched
    second = prepare_examples([src], out, path, None, seq_len=16, val_fraction=0, overwrite=True)
    assert second["splits"]["train"]["examples"] == 1
    tokens, _ = ExampleSplit(out, "train").example(0)
    assert tokens.tolist() == [tok.bos_id] + tok.encode("three") + [tok.eos_id]
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".")]  # no temporary directory left
