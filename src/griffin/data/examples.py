"""Fine-tuning examples: JSON lines of chats, prompt/completion pairs or texts, tokenized with a loss mask and packed
into training rows with document resets (``griffin finetune``, docs/finetuning.md).

One JSON object a line, in one of three shapes (other keys are ignored)::

    {"messages": [{"role": "user", "content": "..."}, {"role": "assistant", "content": "..."}, ...]}
    {"prompt": "...", "completion": "..."}
    {"text": "..."}

A chat is rendered with a chat template (:class:`griffin.data.chat.ChatTemplate`): its loss falls on the assistant's
replies. A pair is ``BOS prompt completion EOS``: its loss falls on the completion and EOS. A text is ``BOS text EOS``,
all of it trained. ``loss_on="all"`` trains on every token of every example.

:func:`prepare_examples` writes a dataset directory::

    out_dir/meta.json                   format "griffin-examples", tokenizer, per split: examples, tokens, targets
    out_dir/{split}-tokens.npy          the examples' token ids, one after the other
    out_dir/{split}-mask.npy            per token: whether it is a target (its prediction is trained)
    out_dir/{split}-offsets.npy         int64 start of each example, and the end
    out_dir/{split}-prompts.npy         int64 length of each example's prompt: the tokens before its last reply
                                        (0 for a text, or with loss_on="all": nothing to generate from)
    out_dir/chat_template.jinja         the template the chats were rendered with (``griffin finetune`` copies it
                                        into its checkpoints, where ``griffin serve`` finds it)

:class:`ExampleLoader` packs whole examples into rows of ``seq_len`` tokens (never splitting one), in an order
shuffled each epoch; every example starts at position 0, so it sees nothing of the one before it in the row
(Section 2.4's document resets), and padding fills the rest of the row (position -1, no target).
"""

from __future__ import annotations

import json
import math
import shutil
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch

from griffin.data.chat import TEMPLATE_FILE, ChatTemplate, message_text
from griffin.data.dataset import SPLITS, check_out_dir, install_dataset, tokenizer_spec_file
from griffin.data.loader import Batch
from griffin.data.tokenizer import Tokenizer, load_tokenizer
from griffin.io import OutputExistsError, create_temp
from griffin.ops.cross_entropy import IGNORE_INDEX

FORMAT = "griffin-examples"
FORMAT_VERSION = 1
ROLES = ("system", "user", "assistant", "tool")
LOSS_ON = ("response", "all")
SHAPES = "{\"messages\": [...]}, {\"prompt\": ..., \"completion\": ...} or {\"text\": ...}"


@dataclass
class Example:
    """One tokenized example: ``ids`` and, per token, whether it is a target (``mask``); ``prompt``: the tokens before
    its last reply (0: none to generate from); ``where``: ``file:line``."""

    ids: list[int]
    mask: list[bool]
    prompt: int
    where: str


def read_records(path: str | Path) -> Iterator[tuple[str, dict[str, Any]]]:
    """``(file:line, record)`` for each non-blank line of a JSONL file; a line that is not a JSON object is a
    ValueError naming it."""
    path = Path(path)
    with open(path, encoding="utf-8-sig") as f:  # a byte-order mark before the first line is no JSON
        for number, line in enumerate(f, 1):
            if not line.strip():
                continue
            where = f"{path}:{number}"
            try:
                record = json.loads(line)
            except json.JSONDecodeError as err:
                raise ValueError(f"{where}: not a JSON line: {err.msg} (column {err.colno})") from None
            if not isinstance(record, dict):
                raise ValueError(f"{where}: expected a JSON object ({SHAPES}), got {type(record).__name__}")
            yield where, record


def record_kind(record: dict[str, Any], where: str) -> str:
    """``chat``, ``completion`` or ``text``: the shape of a record, checked (roles, an assistant turn, string fields);
    a record of no shape, or of two, is a ValueError naming ``where`` and what is wrong."""
    shapes = [k for k, keys in (("chat", ("messages",)), ("completion", ("prompt", "completion")), ("text", ("text",)))
              if any(key in record for key in keys)]
    if len(shapes) != 1:
        found = f"keys {sorted(record)}" if shapes == [] else f"keys of {' and '.join(shapes)} examples"
        raise ValueError(f"{where}: expected one of {SHAPES}; found {found}")
    kind = shapes[0]
    if kind == "chat":
        messages = record["messages"]
        if not isinstance(messages, list) or not messages:
            raise ValueError(f"{where}: 'messages' must be a non-empty list of {{role, content}} objects")
        for i, m in enumerate(messages):
            if not isinstance(m, dict) or "role" not in m or "content" not in m:
                raise ValueError(f"{where}: messages[{i}] must be an object with 'role' and 'content'")
            if m["role"] not in ROLES:
                raise ValueError(f"{where}: messages[{i}] has the unknown role {m['role']!r}; roles: "
                                 f"{', '.join(ROLES)}")
            try:
                message_text(m["content"])
            except ValueError as err:
                raise ValueError(f"{where}: messages[{i}]: {err}") from None
        if not any(m["role"] == "assistant" for m in messages):
            raise ValueError(f"{where}: the chat has no assistant turn, so nothing to learn from: add the reply as a "
                             "message with role 'assistant'")
        return kind
    for key in ("prompt", "completion") if kind == "completion" else ("text",):
        if not isinstance(record.get(key), str):
            raise ValueError(f"{where}: {key!r} must be a string, got "
                             f"{'nothing' if key not in record else type(record[key]).__name__}")
    return kind


class ExampleEncoder:
    """Records to :class:`Example` s with ``tokenizer`` and, for chats, ``template`` (None: chats are refused)."""

    def __init__(self, tokenizer: Tokenizer, template: ChatTemplate | None, loss_on: str = "response") -> None:
        if loss_on not in LOSS_ON:
            raise ValueError(f"loss_on={loss_on!r} must be one of {LOSS_ON}")
        self.tokenizer, self.template, self.loss_on = tokenizer, template, loss_on
        self.bos = [tokenizer.bos_id] if tokenizer.bos_id is not None else []
        self.eos = [tokenizer.eos_id] if tokenizer.eos_id is not None else []

    def __call__(self, record: dict[str, Any], where: str) -> Example:
        kind = record_kind(record, where)
        if kind == "chat":
            if self.template is None:
                raise ValueError(f"{where}: a chat needs a chat template, and the checkpoint has none (no "
                                 "chat_template in its tokenizer_config.json, no chat_template.jinja): pass "
                                 "--chat-template plain for griffin's <|role|> template, or a .jinja file")
            try:
                ids, mask = self.template.conversation(record["messages"])
            except ValueError as err:
                raise ValueError(f"{where}: {err}") from None
        elif kind == "completion":
            prompt = self.bos + self.tokenizer.encode(record["prompt"])
            reply = self.tokenizer.encode(record["completion"]) + self.eos
            ids, mask = prompt + reply, [False] * len(prompt) + [True] * len(reply)
        else:
            ids = self.bos + self.tokenizer.encode(record["text"]) + self.eos
            mask = [True] * len(ids)
        if ids:
            mask[0] = False  # nothing predicts an example's first token
        prompt = 0
        if kind != "text" and self.loss_on == "response" and any(mask):
            last = len(mask) - 1 - mask[::-1].index(True)  # the last reply: its first token follows the prompt
            prompt = last
            while prompt > 0 and mask[prompt - 1]:
                prompt -= 1
        if self.loss_on == "all":
            mask = [False] + [True] * (len(ids) - 1)
        return Example(ids, mask, prompt, where)


@dataclass
class _Split:
    tokens: list[np.ndarray]
    masks: list[np.ndarray]
    prompts: list[int]


def prepare_examples(files: Sequence[str | Path], out_dir: str | Path, tokenizer: str | Path | Tokenizer,
                     template: str | None, *, seq_len: int, loss_on: str = "response", truncate: bool = False,
                     val_fraction: float = 0.05, seed: int = 0, overwrite: bool = False,
                     tokenizer_name: str | None = None, val_files: Sequence[str | Path] = ()) -> dict[str, Any]:
    """Tokenize the examples of JSONL ``files`` into a dataset in ``out_dir`` and return its meta.

    ``template``: a chat template's Jinja source, ``"plain"`` for griffin's plain template, or None (a chat is then
    refused, naming its line). An example longer than ``seq_len`` tokens is refused, naming its line, unless
    ``truncate``: then its end is cut (the count is in the meta as ``truncated``; an example left with no target is
    dropped and counted as ``dropped``). The examples of ``val_files`` are held out if given; else
    ``round(n * val_fraction)`` examples (at least one of two or more), chosen by a permutation seeded with ``seed``.
    ``tokenizer``: a spec for :func:`~griffin.data.tokenizer.load_tokenizer` (its file is copied into the dataset) or
    a tokenizer object (``tokenizer_name`` then names its file in the meta, None: not copied)."""
    if seq_len < 2:
        raise ValueError(f"seq_len={seq_len} must be at least 2")
    if not 0 <= val_fraction < 1:
        raise ValueError(f"val_fraction must be in [0, 1), got {val_fraction}")
    out_dir = Path(out_dir)
    if check_out_dir(out_dir) and not overwrite:
        raise OutputExistsError(f"{out_dir} already holds a prepared dataset: pass --overwrite to replace it")
    tok_file = None
    if isinstance(tokenizer, (str, Path)):
        tok_file = tokenizer_spec_file(tokenizer)
        tok = load_tokenizer(tokenizer)
    else:
        tok = tokenizer
    chat = None if template is None else ChatTemplate(tok, None if template == "plain" else template)
    encode = ExampleEncoder(tok, chat, loss_on)
    examples: list[Example] = []
    truncated = dropped = 0
    too_long: list[Example] = []
    val_files = list(val_files or [])
    first_val = None
    for file in [*files, *val_files]:
        if file in val_files and first_val is None:
            first_val = len(examples)
        if not Path(file).is_file():
            raise FileNotFoundError(f"no examples file at {file}")
        for where, record in read_records(file):
            example = encode(record, where)
            if len(example.ids) > seq_len:
                if not truncate:
                    too_long.append(example)
                    continue
                truncated += 1
                example.ids, example.mask = example.ids[:seq_len], example.mask[:seq_len]
                if example.prompt >= seq_len:
                    example.prompt = 0
            if not any(example.mask):
                dropped += 1
                continue
            bad = [i for i in example.ids if not 0 <= i < tok.vocab_size]
            if bad:
                raise ValueError(f"{example.where}: token id {bad[0]} is outside the vocabulary ({tok.vocab_size})")
            examples.append(example)
    if too_long:
        first = too_long[0]
        longest = max(len(e.ids) for e in too_long)
        raise ValueError(f"{first.where}: the example has {len(first.ids)} tokens, more than --seq-len {seq_len} "
                         f"({len(too_long)} examples are longer, the longest {longest} tokens): raise --seq-len, or "
                         "pass --truncate to cut them to seq_len tokens")
    n = len(examples)
    is_val = np.zeros(n, bool)
    if first_val is not None:  # the held-out examples are given
        is_val[first_val:] = True
        if first_val == n:
            raise ValueError(f"{', '.join(map(str, val_files))}: no example with a token to evaluate on")
    else:
        n_val = min(max(1, round(n * val_fraction)), n - 1) if val_fraction > 0 and n >= 2 else 0
        is_val[np.random.default_rng(seed).permutation(n)[:n_val]] = True
    if is_val.all():
        raise ValueError(f"{', '.join(map(str, files))}: no example with a token to train on")
    out_dir.parent.mkdir(parents=True, exist_ok=True)
    tmp = create_temp(out_dir.parent, f".{out_dir.name}.tmp-", directory=True)
    try:
        splits = {}
        dtype = np.uint16 if tok.vocab_size <= 1 << 16 else np.uint32
        for split in SPLITS:
            chosen = [e for e, v in zip(examples, is_val, strict=True) if v == (split == "val")]
            lengths = np.array([len(e.ids) for e in chosen], np.int64)
            offsets = np.concatenate([[0], np.cumsum(lengths)]).astype(np.int64)
            tokens = np.array([i for e in chosen for i in e.ids], dtype)
            mask = np.array([m for e in chosen for m in e.mask], bool)
            np.save(tmp / f"{split}-tokens.npy", tokens)
            np.save(tmp / f"{split}-mask.npy", mask)
            np.save(tmp / f"{split}-offsets.npy", offsets)
            np.save(tmp / f"{split}-prompts.npy", np.array([e.prompt for e in chosen], np.int64))
            splits[split] = {"examples": len(chosen), "tokens": int(len(tokens)), "targets": int(mask.sum())}
        if chat is not None:
            (tmp / TEMPLATE_FILE).write_text(chat.source, encoding="utf-8")
        name = tokenizer_name
        if tok_file is not None:
            name = "tokenizer" + tok_file.suffix
            shutil.copyfile(tok_file, tmp / name)
        elif isinstance(tokenizer, (str, Path)):
            name = "bytes"
        meta = {
            "format": FORMAT, "version": FORMAT_VERSION, "tokenizer": name, "vocab_size": tok.vocab_size,
            "bos_id": tok.bos_id, "eos_id": tok.eos_id, "splits": splits,
            "sources": [str(Path(f).resolve()) for f in files],
            "val_sources": [str(Path(f).resolve()) for f in val_files], "seq_len": seq_len, "loss_on": loss_on,
            "template": "none" if template is None else "plain" if template == "plain" else "jinja",
            "template_source": None if template in (None, "plain") else template,
            "truncate": truncate, "truncated": truncated, "dropped": dropped, "seed": seed,
            "val_fraction": val_fraction,
        }
        (tmp / "meta.json").write_text(json.dumps(meta, indent=2) + "\n")
        install_dataset(tmp, out_dir)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return meta


def is_examples(data_dir: str | Path) -> bool:
    """Whether ``data_dir`` holds a dataset of examples (:func:`prepare_examples`) rather than a token stream."""
    path = Path(data_dir) / "meta.json"
    return path.is_file() and json.loads(path.read_text()).get("format") == FORMAT


def load_examples_meta(data_dir: str | Path) -> dict[str, Any]:
    """The meta of an examples dataset, checked (format and the files of each split)."""
    data_dir = Path(data_dir)
    path = data_dir / "meta.json"
    if not path.is_file():
        raise FileNotFoundError(f"no meta.json in {data_dir}: prepare the examples first")
    meta = json.loads(path.read_text())
    if meta.get("format") != FORMAT or meta.get("version") != FORMAT_VERSION:
        raise ValueError(f"{path} is not a {FORMAT} v{FORMAT_VERSION} dataset")
    for split in meta["splits"]:
        for part in ("tokens", "mask", "offsets", "prompts"):
            if not (data_dir / f"{split}-{part}.npy").is_file():
                raise FileNotFoundError(f"{data_dir / f'{split}-{part}.npy'} (split {split!r}) is missing")
    return meta


class ExampleSplit:
    """A split's examples, memory-mapped: ``example(i)`` gives the tokens and mask of example i."""

    def __init__(self, data_dir: str | Path, split: str) -> None:
        data_dir = Path(data_dir)
        self.meta = load_examples_meta(data_dir)
        if split not in self.meta["splits"]:
            raise ValueError(f"{data_dir} has no split {split!r}")
        load = {part: np.load(data_dir / f"{split}-{part}.npy", mmap_mode="r", allow_pickle=False)
                for part in ("tokens", "mask", "offsets", "prompts")}
        self.tokens, self.mask, self.offsets, self.prompts = (load[k] for k in ("tokens", "mask", "offsets", "prompts"))
        self.lengths = np.diff(np.asarray(self.offsets))
        if len(self.tokens) != self.meta["splits"][split]["tokens"]:
            raise ValueError(f"split {split!r} of {data_dir}: {len(self.tokens)} tokens on disk, meta.json says "
                             f"{self.meta['splits'][split]['tokens']}")

    def __len__(self) -> int:
        return len(self.lengths)

    def example(self, i: int) -> tuple[np.ndarray, np.ndarray]:
        a, b = int(self.offsets[i]), int(self.offsets[i + 1])
        return np.asarray(self.tokens[a:b], np.int64), np.asarray(self.mask[a:b], bool)


def pack(lengths: np.ndarray, order: np.ndarray, seq_len: int) -> list[np.ndarray]:
    """Rows of example indices, in ``order``: each row takes the next examples while their tokens fit in
    ``seq_len`` (no example is split; each is at most ``seq_len`` long)."""
    rows, row, used = [], [], 0
    for i in order:
        n = int(lengths[i])
        if used + n > seq_len and row:
            rows.append(np.asarray(row, np.int64))
            row, used = [], 0
        row.append(int(i))
        used += n
    if row:
        rows.append(np.asarray(row, np.int64))
    return rows


def packed_batch(split: ExampleSplit, rows: Sequence[np.ndarray], seq_len: int) -> Batch:
    """The batch of packed ``rows``: each example at positions 0, 1, ... (a document start), its targets the next
    tokens where the mask says so; padding (token 0, position -1, no target) after the last one."""
    B = len(rows)
    ids = np.zeros((B, seq_len), np.int64)
    positions = np.full((B, seq_len), -1, np.int64)
    targets = np.full((B, seq_len), IGNORE_INDEX, np.int64)
    for r, row in enumerate(rows):
        at = 0
        for i in row:
            tokens, mask = split.example(int(i))
            n = len(tokens)
            ids[r, at:at + n] = tokens
            positions[r, at:at + n] = np.arange(n)
            targets[r, at:at + n - 1] = np.where(mask[1:], tokens[1:], IGNORE_INDEX)
            at += n
    return Batch(torch.from_numpy(ids), torch.from_numpy(positions), torch.from_numpy(targets))


class ExampleLoader:
    """Endless batches of packed examples from a split (the interface of :class:`griffin.data.PackedLoader`).

    Each epoch orders the examples by ``np.random.default_rng([seed, epoch])`` (in order when ``shuffle=False``) and
    packs them into rows (:func:`pack`); rank ``r`` of ``world_size`` takes rows ``r, r + world_size, ...`` of the
    first ``rows // world_size * world_size``. The state is the same on every rank."""

    def __init__(self, data_dir: str | Path, split: str, seq_len: int, batch_size: int, *, seed: int = 0,
                 shuffle: bool = True, rank: int = 0, world_size: int = 1) -> None:
        if seq_len < 1 or batch_size < 1:
            raise ValueError(f"seq_len and batch_size must be positive, got {seq_len} and {batch_size}")
        self.data_dir, self.split = Path(data_dir), split
        self.seq_len, self.batch_size, self.seed, self.shuffle = seq_len, batch_size, seed, shuffle
        self.rank, self.world_size = rank, world_size
        self.data = ExampleSplit(data_dir, split)
        self.meta = self.data.meta
        if len(self.data) == 0:
            raise ValueError(f"split {split!r} of {data_dir} has no examples")
        longest = int(self.data.lengths.max())
        if longest > seq_len:
            raise ValueError(f"split {split!r} of {data_dir} holds an example of {longest} tokens, more than seq_len "
                             f"{seq_len}: prepare it again with this seq_len")
        self._epoch = self._index = 0
        self._rows_epoch, self._rows = -1, []
        least = -(-len(self.data.tokens) // seq_len)  # the fewest rows any epoch's packing can give
        if least < world_size:
            raise ValueError(f"split {split!r} of {data_dir} holds {len(self.data.tokens)} tokens: at least "
                             f"{world_size * seq_len - seq_len + 1} are needed to give each of the {world_size} "
                             f"data-parallel ranks a row of seq_len {seq_len} in every epoch")

    def _epoch_rows(self, epoch: int) -> list[np.ndarray]:
        """This rank's rows of ``epoch``."""
        if epoch != self._rows_epoch:
            n = len(self.data)
            order = np.random.default_rng([self.seed, epoch]).permutation(n) if self.shuffle else np.arange(n)
            rows = pack(self.data.lengths, order, self.seq_len)
            self._rows = rows[: len(rows) // self.world_size * self.world_size][self.rank :: self.world_size]
            self._rows_epoch = epoch
        return self._rows

    @property
    def windows_per_rank(self) -> int:
        """Rows per rank in the current epoch."""
        return len(self._epoch_rows(self._epoch))

    @property
    def num_windows(self) -> int:
        return self.windows_per_rank * self.world_size

    @property
    def tokens_per_epoch(self) -> int:
        return self.num_windows * self.seq_len

    @property
    def epoch(self) -> float:
        return self._epoch + self._index / self.windows_per_rank

    def next_rows(self) -> list[np.ndarray]:
        out: list[np.ndarray] = []
        while len(out) < self.batch_size:
            rows = self._epoch_rows(self._epoch)
            take = min(self.batch_size - len(out), len(rows) - self._index)
            out += rows[self._index:self._index + take]
            self._index += take
            if self._index == len(rows):
                self._epoch, self._index = self._epoch + 1, 0
        return out

    def __iter__(self) -> ExampleLoader:
        return self

    def __next__(self) -> Batch:
        return packed_batch(self.data, self.next_rows(), self.seq_len)

    def state_dict(self) -> dict[str, Any]:
        return {"split": self.split, "epoch": self._epoch, "index": self._index, "seed": self.seed,
                "seq_len": self.seq_len, "batch_size": self.batch_size, "shuffle": self.shuffle,
                "world_size": self.world_size,
                "dataset": {"examples": len(self.data), "tokens": int(len(self.data.tokens)),
                            "vocab_size": self.meta["vocab_size"]}}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        mine = self.state_dict()
        keys = ("split", "seed", "seq_len", "batch_size", "shuffle", "world_size", "dataset")
        diff = [f"{k}: {state.get(k)!r} in the state, {mine[k]!r} here" for k in keys if state.get(k) != mine[k]]
        if diff:
            raise ValueError("loader state does not match this loader: " + "; ".join(diff))
        epoch, index = int(state["epoch"]), int(state["index"])
        if epoch < 0 or not 0 <= index < len(self._epoch_rows(epoch)):
            raise ValueError(f"loader state at epoch {epoch}, row {index} is out of range")
        self._epoch, self._index = epoch, index


def example_eval_batches(data_dir: str | Path, split: str, seq_len: int, batch_size: int,
                         max_batches: int | None = None) -> list[Batch]:
    """Fixed batches of the split's examples packed in order (the last batch may be smaller), at most
    ``max_batches``."""
    data = ExampleSplit(data_dir, split)
    rows = pack(data.lengths, np.arange(len(data)), seq_len)
    n = math.ceil(len(rows) / batch_size)
    if max_batches is not None:
        n = min(n, max_batches)
    return [packed_batch(data, rows[i * batch_size:(i + 1) * batch_size], seq_len) for i in range(n)]


def examples_unigram_loss(data_dir: str | Path) -> float:
    """The unigram baseline over the targets: cross-entropy of the val targets under the train targets'
    frequencies, add-one smoothed."""
    meta = load_examples_meta(data_dir)
    vocab = meta["vocab_size"]
    counts = {}
    for split in SPLITS:
        data = ExampleSplit(data_dir, split)
        counts[split] = np.bincount(np.asarray(data.tokens)[np.asarray(data.mask)], minlength=vocab)[:vocab]
    if counts["val"].sum() == 0:
        raise ValueError(f"the val split of {data_dir} has no targets (prepare with val_fraction > 0)")
    log_p = np.log(counts["train"] + 1.0) - np.log(counts["train"].sum() + vocab)
    return float(-(counts["val"] * log_p).sum() / counts["val"].sum())
