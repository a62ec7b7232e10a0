"""The training loop (Section 3): AdamW, linear warm-up then cosine decay, clipping, accumulation, bf16 autocast.

``train(TrainConfig(...))`` prepares the data if needed, builds the model, trains, evaluates on held-out data,
writes checkpoints that resume exactly (see :mod:`griffin.training.checkpoint`), logs JSON lines and TensorBoard
events, plots the loss curves and prints a sample. ``griffin train`` is its command line.

A run stops early on request (``train(cfg, stop=...)``: a :class:`StopRequest`, a ``threading.Event`` or a callable;
``griffin train`` sets one on SIGTERM): at the next step boundary it writes the checkpoint of that step and raises
:class:`TrainingStopped`; ``resume="auto"`` then continues exactly as a run that never stopped.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import json
import math
import signal
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import load_file
from torch import Tensor

from griffin.data.chat import TEMPLATE_FILE
from griffin.data.examples import (
    ExampleLoader,
    ExampleSplit,
    example_eval_batches,
    examples_unigram_loss,
    is_examples,
)
from griffin.data.tokenizer import load_tokenizer
from griffin.finetune.lora import read_lora, write_lora
from griffin.inference import generate
from griffin.interop import DTYPES, CheckpointError
from griffin.interop.adapters import LoraSettings
from griffin.io import atomic_write, write_safetensors
from griffin.model import CausalLM, LanguageModelLoss
from griffin.ops.cross_entropy import IGNORE_INDEX
from griffin.parallel import ParallelDims, shard_sequence
from griffin.training.checkpoint import (
    find_resumable,
    list_checkpoints,
    load_checkpoint,
    prune,
    save_checkpoint,
    set_link,
    step_dir,
)
from griffin.training.config import RUN_KEYS, TrainConfig, same_setting
from griffin.training.distributed import init_distributed
from griffin.training.fast import CompiledStep, resolve_autocast
from griffin.training.layout import Layout, even_share, load_any, translate_loader_state, wants_layout
from griffin.training.source import BatchSource


class TrainingError(RuntimeError):
    """Training cannot go on (a non-finite loss, for instance); the last checkpoint on disk is intact."""


class TrainingStopped(Exception):
    """Training stopped on request (:class:`StopRequest`; SIGTERM in ``griffin train``) at a step boundary, once
    the checkpoint of that step was on disk: ``checkpoint`` (None: stopped before the first step of a new run, with
    nothing to save). Resuming (``resume="auto"``) continues as if the run had not stopped."""

    def __init__(self, reason: str, step: int, checkpoint: Path | None, out: Path) -> None:
        self.reason, self.step, self.checkpoint, self.out = reason, step, checkpoint, out
        saved = f"checkpoint: {checkpoint}" if checkpoint is not None else "no checkpoint written yet"
        super().__init__(f"training stopped by {reason} after step {step}; {saved}")


class StopRequest:
    """A request to stop training at the next step boundary (``train(cfg, stop=request)``), set by :meth:`set`
    (from any thread) or by a signal (:meth:`on_signal`). Under torchrun every rank passes one (or none): one rank's
    request stops them all at the same step."""

    def __init__(self) -> None:
        self.reason: str | None = None

    def set(self, reason: str = "a stop request") -> None:
        """Ask for the stop; ``reason`` is what :class:`TrainingStopped` says stopped the run (the first one kept)."""
        if self.reason is None:
            self.reason = reason

    def is_set(self) -> bool:
        return self.reason is not None

    @classmethod
    @contextlib.contextmanager
    def on_signal(cls, signum: int = signal.SIGTERM) -> Iterator[StopRequest]:
        """A request that the signal ``signum`` sets (reason: its name, e.g. ``"SIGTERM"``) while the ``with`` block
        runs; the default handler is back afterwards. Installed only from the main thread over the default handler
        (a host program's own handler, or an ignored signal, is left alone: the request is then set only by
        :meth:`set`). Repeated signals change nothing (a launcher may forward the same one twice); SIGKILL ends the
        process at once."""
        request = cls()
        if threading.current_thread() is not threading.main_thread() or signal.getsignal(signum) != signal.SIG_DFL:
            yield request
            return
        name = signal.Signals(signum).name
        signal.signal(signum, lambda received, frame: request.set(name))
        try:
            yield request
        finally:
            signal.signal(signum, signal.SIG_DFL)


#: ``resume`` values that take the newest intact checkpoint in OUT/checkpoints.
RESUME_NEWEST = ("auto", "if-any")
SOURCE_STATE = "source_state.safetensors"  # a batch source's tensors in a checkpoint (its state_tensors())


def resume_checkpoint(out: str | Path, resume: str) -> Path | None:
    """The checkpoint a run in ``out`` resumes from: ``resume`` itself if it is a path; for ``"auto"`` and
    ``"if-any"`` the newest intact one in ``out/checkpoints`` (None if there is none yet: the run starts here;
    ``griffin train --resume`` refuses that for ``"auto"``); None if ``resume`` is empty."""
    if not resume:
        return None
    if resume not in RESUME_NEWEST:
        return Path(resume)
    root = Path(out) / "checkpoints"
    path = find_resumable(root)
    if path is None and list_checkpoints(root):
        raise CheckpointError(f"no checkpoint in {root} is intact; resume from one explicitly or start in another "
                              "--out")
    return path


def saved_run_config(path: str | Path) -> tuple[dict[str, Any], dict[str, Any]]:
    """The training settings (``trainer.json``'s ``config``) and the model config (``config.json``) a checkpoint
    was written with, read without loading any weights; a missing or unreadable file is a CheckpointError naming it."""
    path = Path(path)
    if not path.is_dir():
        raise CheckpointError(f"no checkpoint directory at {path}")
    found = []
    for name in ("trainer.json", "config.json"):
        file = path / name
        try:
            data = json.loads(file.read_text())
        except FileNotFoundError:
            raise CheckpointError(f"{path} has no {name}: not a checkpoint of `griffin train`") from None
        except (OSError, UnicodeDecodeError, json.JSONDecodeError) as err:
            raise CheckpointError(f"{file} is unreadable: {err}") from None
        if not isinstance(data, dict):
            raise CheckpointError(f"{file} is not a JSON object")
        found.append(data)
    settings = found[0].get("config", {})
    if not isinstance(settings, dict):
        raise CheckpointError(f"{path / 'trainer.json'}: config is not a JSON object")
    return settings, found[1]


# Pieces -----------------------------------------------------------------------------------------------------
def resolve_device(name: str) -> torch.device:
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    device = torch.device(name)
    if device.type == "cuda" and not torch.cuda.is_available():
        raise ValueError(f"device={name!r} but CUDA is not available")
    return device


def resolve_precision(precision: str, device: torch.device) -> torch.dtype | None:
    """The autocast dtype, or None for plain fp32."""
    if precision == "fp32":
        return None
    if precision == "bf16":
        return torch.bfloat16
    if device.type == "cuda" and torch.cuda.is_bf16_supported():
        return torch.bfloat16
    return None


def resolve_float32_logits(cfg: TrainConfig, device: torch.device, autocast: torch.dtype | None,
                           loss: torch.nn.Module) -> bool:
    """Whether the loss computes its logits in float32 under autocast (``TrainConfig.logits_precision``). 'auto':
    on CPU, where the output layer is a small share of the step, with float32 weights; not for another loss (the
    vocabulary-parallel one of a tensor-parallel layout), which an explicit 'fp32' is refused for."""
    if autocast is None or cfg.logits_precision == "bf16":
        return False
    plain = isinstance(loss, LanguageModelLoss)
    if cfg.logits_precision == "fp32":
        if not plain:
            raise ValueError(f"logits_precision='fp32' is not supported by {type(loss).__name__} (tp > 1): use "
                             "'bf16' or 'auto'")
        return True
    return plain and device.type == "cpu" and not (cfg.lora_rank and cfg.base_dtype != "float32")


def no_weight_decay(name: str, param: Tensor) -> bool:
    """Norm scales, biases and the RG-LRU decay parameter Λ are not decayed."""
    leaf = name.rsplit(".", 1)[-1]
    return param.ndim < 2 or leaf in ("b", "bias", "a_param", "theta") or "norm" in name


def build_optimizer(model: CausalLM, cfg: TrainConfig) -> torch.optim.AdamW:
    decay, plain = [], []
    for name, param in model.named_parameters():
        if param.requires_grad:
            (plain if no_weight_decay(name, param) else decay).append(param)
    groups = [{"params": decay, "weight_decay": cfg.weight_decay}, {"params": plain, "weight_decay": 0.0}]
    # the fused kernel: always on CUDA; on CPU in the fast step of one process (--compile without a layout), the
    # uncompiled step being the reference
    device = next(model.parameters()).device.type
    fast_cpu = device == "cpu" and cfg.compile and not wants_layout(cfg)
    fused = {"fused": True} if device == "cuda" or fast_cpu else {}
    return torch.optim.AdamW(groups, lr=cfg.lr, betas=(cfg.beta1, cfg.beta2), eps=cfg.adam_eps, **fused)


def learning_rate(step: int, cfg: TrainConfig) -> float:
    """Learning rate of update ``step`` (0-based): linear warm-up, then cosine decay to ``min_lr_ratio * lr``."""
    if step < cfg.warmup_steps:
        return cfg.lr * (step + 1) / cfg.warmup_steps
    progress = min(1.0, (step - cfg.warmup_steps) / max(1, cfg.max_steps - cfg.warmup_steps))
    low = cfg.lr * cfg.min_lr_ratio
    return low + 0.5 * (cfg.lr - low) * (1.0 + math.cos(math.pi * progress))


def run_tokenizer(cfg: TrainConfig) -> str:
    """The tokenizer the run's data is prepared with: ``cfg.tokenizer``, except that a fine-tune (``--init``) left at
    the default takes the checkpoint's own (beside it, as ``griffin generate`` finds it), if it has one."""
    from griffin.data.tokenizer import tokenizer_file

    if cfg.init and cfg.tokenizer == "bytes":
        init = Path(cfg.init)
        found = tokenizer_file(init if init.is_dir() else init.parent)
        return str(found) if found is not None else "bytes"
    return cfg.tokenizer


def chat_template(cfg: TrainConfig) -> str | None:
    """The chat template of the run's chats: the Jinja source, ``"plain"``, or None (none found: chats are refused)."""
    from griffin.data.chat import find_chat_template

    if cfg.chat_template == "plain":
        return "plain"
    if cfg.chat_template != "auto":
        return Path(cfg.chat_template).read_text(encoding="utf-8")
    tokenizer = run_tokenizer(cfg)
    return find_chat_template(cfg.init or None, None if tokenizer == "bytes" else tokenizer)


def example_files(cfg: TrainConfig) -> list[Path] | None:
    """The JSON-lines files of fine-tuning examples ``cfg.data`` names (:mod:`griffin.data.examples`), or None when
    it names text to pretrain on: JSONL files are examples in a fine-tune (``--init``), or when their first record
    is a chat or a prompt/completion pair."""
    from griffin.data.examples import read_records

    if not cfg.data:
        return None
    paths = [Path(p) for p in cfg.data.split(",")]
    if not all(p.is_file() and p.suffix in (".jsonl", ".json") and p.name != "meta.json" for p in paths):
        return None
    if cfg.init:
        return paths
    for _, record in read_records(paths[0]):
        return paths if "messages" in record or "prompt" in record else None
    return None


def prepare_data(cfg: TrainConfig, out: Path) -> Path:
    """The prepared dataset to train on: ``cfg.data`` itself if it is one, else prepared into ``OUT/data`` (and
    reused from there while the sources, tokenizer, split fraction and seed, and for examples their settings, are
    unchanged)."""
    import sysconfig

    from griffin.data import load_meta, prepare
    from griffin.data.examples import is_examples, prepare_examples

    if cfg.data and (Path(cfg.data) / "meta.json").is_file():
        return Path(cfg.data)
    if cfg.data and Path(cfg.data).name == "meta.json" and Path(cfg.data).is_file():
        return Path(cfg.data).parent  # a prepared dataset named by its meta file, not a JSON-lines file
    sources = [str(Path(p).resolve()) for p in cfg.data.split(",")] if cfg.data else None
    for source in sources or []:
        if not Path(source).exists():
            raise FileNotFoundError(f"data={source!r} does not exist")
    target = out / "data"
    tokenizer_spec = run_tokenizer(cfg)
    tokenizer = "bytes" if tokenizer_spec == "bytes" else Path(tokenizer_spec).name
    examples = example_files(cfg)
    if cfg.val_data and examples is None:
        raise ValueError(f"--val-data {cfg.val_data} holds examples to evaluate on; --data {cfg.data or '(none)'} "
                         "names no JSONL examples to train on")
    if examples is not None:
        template = chat_template(cfg)
        val_sources = [str(Path(p).resolve()) for p in cfg.val_data.split(",")] if cfg.val_data else []
        wanted = {"sources": sources, "val_sources": val_sources, "seed": cfg.seed, "val_fraction": cfg.val_fraction,
                  "seq_len": cfg.seq_len, "loss_on": cfg.loss_on, "truncate": cfg.truncate,
                  "template": "none" if template is None else "plain" if template == "plain" else "jinja",
                  "template_source": None if template in (None, "plain") else template}
        if is_examples(target):
            meta = load_meta_any(target)
            same_tokenizer = meta["tokenizer"] in (tokenizer, "tokenizer" + Path(tokenizer).suffix)
            if same_tokenizer and all(meta.get(k) == v for k, v in wanted.items()):
                return target
        meta = prepare_examples(examples, target, tokenizer_spec, template, seq_len=cfg.seq_len, loss_on=cfg.loss_on,
                                truncate=cfg.truncate, val_fraction=cfg.val_fraction, seed=cfg.seed, overwrite=True,
                                val_files=val_sources)
        if meta["truncated"]:
            print(f"griffin train: {meta['truncated']} examples longer than seq_len {cfg.seq_len} were cut",
                  flush=True)
        if meta["dropped"]:
            print(f"griffin train: {meta['dropped']} examples with no token to train on (a reply cut off, or a single "
                  "token) were left out", flush=True)
        return target
    if (target / "meta.json").is_file() and not is_examples(target):
        meta = load_meta(target)
        wanted = sources or [sysconfig.get_paths()["stdlib"]]
        if (meta["sources"], meta["tokenizer"], meta["val_fraction"], meta["seed"]) == \
                (wanted, tokenizer, cfg.val_fraction, cfg.seed):
            return target
    prepare(sources, target, tokenizer_spec, val_fraction=cfg.val_fraction, seed=cfg.seed, progress=cfg.progress,
            overwrite=True)  # OUT/data is the run's own: prepared again when its settings changed
    return target


def load_meta_any(data_dir: Path) -> dict[str, Any]:
    """The meta of a prepared dataset of either kind (a token stream, or examples)."""
    from griffin.data import load_meta
    from griffin.data.examples import is_examples, load_examples_meta

    return load_examples_meta(data_dir) if is_examples(data_dir) else load_meta(data_dir)


class JsonLog:
    """Append-only JSON-lines log; on resume, records after the checkpoint's step are dropped (they are redone)."""

    def __init__(self, path: Path, resume_step: int | None) -> None:
        self.path = path
        if resume_step is None:
            path.write_text("")
        elif path.exists():
            kept = [line for line in path.read_text().splitlines()
                    if line.strip() and json.loads(line).get("step", 0) <= resume_step]
            atomic_write(path, lambda tmp: Path(tmp).write_text("".join(line + "\n" for line in kept)))

    def write(self, record: dict[str, Any]) -> None:
        with open(self.path, "a") as f:
            f.write(json.dumps(record) + "\n")

    def records(self) -> list[dict[str, Any]]:
        return [json.loads(line) for line in self.path.read_text().splitlines() if line.strip()]


@dataclass
class TrainResult:
    step: int
    val_loss: float
    best_val_loss: float
    unigram_loss: float
    tokens_per_s: float
    out: Path
    checkpoint: Path
    sample: str = ""
    history: list[dict[str, Any]] = field(default_factory=list)


# The trainer ------------------------------------------------------------------------------------------------
class Trainer:
    """Owns model, optimizer, data and logs of one run; :meth:`run` trains until ``max_steps``.

    The batches come from ``cfg.data`` (a prepared dataset, or files prepared into ``OUT/data``) or, given
    ``source``, from that :class:`~griffin.training.source.BatchSource` (``cfg.data`` is then unused)."""

    def __init__(self, cfg: TrainConfig, source: BatchSource | None = None) -> None:
        from griffin.data import PackedLoader, eval_batches, unigram_loss
        from griffin.flops import peak_flops, training_flops_per_token

        self.started = time.perf_counter()  # every log record's wall_s counts from here
        self.cfg = cfg
        self.out = Path(cfg.out)
        self.out.mkdir(parents=True, exist_ok=True)
        self.ckpt_root = self.out / "checkpoints"
        existing = list_checkpoints(self.ckpt_root)
        if existing and not cfg.resume:
            raise ValueError(f"{self.out} already holds checkpoints of a run (up to {existing[-1].name}): pass "
                             "--resume to continue it, or choose another --out")
        resume_from = self._resume_path()
        if resume_from is not None:  # before anything is built: a run of another model is refused by its settings
            self._check_run_settings(resume_from)
        self.dist, device = init_distributed(cfg.device)
        if wants_layout(cfg):  # a layout the processes cannot form is refused before the data is prepared
            ParallelDims.resolve(self.dist.world_size, cfg.tp, cfg.dp_shard, cfg.dp_replicate, cfg.cp)
        self.device = resolve_device(device)
        self.autocast = resolve_precision(cfg.precision, self.device)
        if cfg.compile and not wants_layout(cfg):  # (a layout compiles its blocks itself)
            self.autocast = resolve_autocast(self.autocast, self.device, cfg.compile_fallback)
        if cfg.threads:
            torch.set_num_threads(cfg.threads)

        self.source = source
        self.whole_rows = False  # every row one document from position 0: no positions given to the model
        self.examples = False  # the data: examples (griffin.data.examples) rather than a token stream
        self.val_examples = None
        self.eval_sample = ""  # the greedy reply to the first held-out example, at the last evaluation
        self.eval_metrics: dict[str, float] = {}  # the source's metrics of the last evaluation
        if source is not None:
            self._use_source(source)
        else:  # Data first: every bad input is refused before a model is built. Rank 0 prepares, the others reuse.
            if self.dist.is_main:
                self.data_dir = prepare_data(cfg, self.out)
            self.dist.barrier()
            if not self.dist.is_main:
                self.data_dir = prepare_data(cfg, self.out)
            self.examples = is_examples(self.data_dir)
            self.meta = load_meta_any(self.data_dir)
            train_split = self.meta["splits"]["train"]
            self.data_line = (f"examples {self.data_dir} ({train_split['examples']:,} train examples, "
                              f"{train_split['targets']:,} target tokens, loss on {self.meta['loss_on']}, vocab "
                              f"{self.meta['vocab_size']})" if self.examples else
                              f"data {self.data_dir} ({train_split['tokens']:,} train tokens, "
                              f"vocab {self.meta['vocab_size']})")
        base = self._base_model() if cfg.init else None
        self.model_config = base.config if base is not None else cfg.model_config(self.meta["vocab_size"])
        if self.model_config.vocab_size < self.meta["vocab_size"]:
            raise ValueError(f"model vocab_size={self.model_config.vocab_size} is smaller than the data's "
                             f"tokenizer ({self.meta['vocab_size']} tokens)"
                             + (": prepare the data with the checkpoint's tokenizer" if cfg.init else ""))
        self.layout = self._layout(cfg, source)
        if source is None:
            rank, world = self.dist.dp_rank, self.dist.dp_size
            loader, batches = (ExampleLoader, example_eval_batches) if self.examples else (PackedLoader, eval_batches)
            self.loader = loader(self.data_dir, "train", cfg.seq_len, cfg.batch_size, seed=cfg.seed,
                                 rank=rank, world_size=world)
            val = batches(self.data_dir, "val", cfg.seq_len, cfg.batch_size, cfg.eval_batches)
            self.val_batches = val[rank::world] if self.layout is None else even_share(val, rank, world)
            self.unigram = examples_unigram_loss(self.data_dir) if self.examples else unigram_loss(self.data_dir)
            tok = self.meta["tokenizer"]
            self.tokenizer_file = None if tok == "bytes" else self.data_dir / tok
            self.tokenizer = load_tokenizer(tok if tok == "bytes" else self.data_dir / tok)
            self.val_examples = ExampleSplit(self.data_dir, "val") if self.examples else None

        torch.manual_seed(cfg.seed)
        if self.layout is not None:  # split and sharded over the mesh (griffin.training.layout)
            self.model = self.layout.build_model(self.model_config, self.device, cfg.seed)
            if base is not None:  # every rank keeps its shards of the checkpoint's weights
                from torch.distributed.checkpoint.state_dict import StateDictOptions, set_model_state_dict

                set_model_state_dict(self.model, base.state_dict(), options=StateDictOptions(full_state_dict=True))
        else:
            self.model = (base if base is not None else CausalLM(self.model_config)).to(self.device)
        del base
        if cfg.lora_rank:  # the frozen model in base_dtype, float32 adapters on the projections (griffin.finetune)
            from griffin.finetune.lora import apply_lora

            self.model.to(DTYPES[cfg.base_dtype])
            self.lora_modules = apply_lora(self.model, LoraSettings(cfg.lora_rank, cfg.lora_alpha, cfg.lora_dropout),
                                           cfg.lora_targets)
        if cfg.activation_checkpointing and self.layout is None:  # (a layout applies its own, inside the shards)
            from griffin.parallel.fsdp import apply_activation_checkpointing

            apply_activation_checkpointing(self.model, preserve_rng_state=cfg.lora_dropout > 0)
        if resolve_float32_logits(cfg, self.device, self.autocast, self.model.loss):
            self.model.loss.float32_logits = True
        self.model.train()
        self.optimizer = build_optimizer(self.model, cfg)
        self.ddp = None
        if self.dist.enabled and self.layout is None:
            from torch.nn.parallel import DistributedDataParallel

            ids = [self.device.index] if self.device.type == "cuda" else None
            self.ddp = DistributedDataParallel(self.model, device_ids=ids)
        wrapped = self.ddp or self.model
        self.forward = CompiledStep(wrapped, cfg.compile_fallback) if cfg.compile and self.layout is None else wrapped
        self.flops_per_token = training_flops_per_token(self.model_config, cfg.seq_len)
        if cfg.lora_rank:  # the frozen weights get no gradient: about 4 of the 6 FLOPs per weight and token
            self.flops_per_token = self.flops_per_token * 2 / 3
        self.peak_flops, self.peak_source = peak_flops(self.device, self.autocast or torch.float32)

        self.step = 0
        self.tokens = 0
        self.best_val = math.inf
        self.best_step: int | None = None
        self.skipped = 0
        if resume_from is not None:
            load = functools.partial(load_checkpoint, read_model=read_lora) if cfg.lora_rank else load_checkpoint
            state = load_any(resume_from, self.model, self.optimizer, self.layout, load,
                             lambda model: build_optimizer(model, cfg))
            self._check_resumable(state, resume_from)
            self.step, self.tokens = state["step"], state["tokens"]
            self.best_val, self.best_step = state["best_val_loss"], state["best_step"]
            loader_state = state["loader"]
            if source is None:  # saved on another number of data-parallel ranks: the same global position
                loader_state = translate_loader_state(loader_state, cfg.batch_size, self.dist.dp_size,
                                                      self.loader.windows_per_rank)
            self.loader.load_state_dict(loader_state)
            if (Path(resume_from) / SOURCE_STATE).is_file() and hasattr(self.loader, "load_state_tensors"):
                self.loader.load_state_tensors(load_file(str(Path(resume_from) / SOURCE_STATE)))
        self.resumed_from = resume_from
        self.log = JsonLog(self.out / "log.jsonl", self.step if resume_from else None) if self.dist.is_main else None
        self.writer = self._tensorboard() if self.dist.is_main else None
        self._bar = None

    def _base_model(self) -> CausalLM:
        """The ``--init`` checkpoint's model, in float32 on the CPU, with ``cfg.model``'s weight-free overrides
        (the local-attention window); for examples, with the Conv1D reset at document starts too (so that no packed
        example sees the one before it; a single sequence is computed the same)."""
        from griffin.interop import load_pretrained
        from griffin.quantize import quantization_of

        base = load_pretrained(self.cfg.init, dtype=torch.float32)
        if quantization_of(base) is not None:
            raise ValueError(f"--init {self.cfg.init} holds int8 weights: fine-tune the float checkpoint it was "
                             "quantised from")
        changes = dict(self.cfg.model)  # only fields no weight depends on (TrainConfig checks)
        if self.examples and not base.config.conv1d_document_reset:
            changes["conv1d_document_reset"] = True
        if changes:
            with torch.device("meta"):
                changed = CausalLM(base.config.replace(**changes))
            changed.load_state_dict(base.state_dict(), assign=True)
            base = changed
        return base.train()

    def _use_source(self, source: BatchSource) -> None:
        """Take batches, held-out metrics and the baseline from ``source`` instead of a prepared dataset."""
        if not isinstance(source, BatchSource):
            raise TypeError(f"source must implement griffin.training.source.BatchSource, got {type(source).__name__}")
        if self.dist.enabled:
            raise ValueError("a BatchSource trains in one process; data parallelism needs a prepared dataset")
        self.data_dir = None
        self.meta = {"vocab_size": int(source.vocab_size), "tokenizer": None}
        self.data_line = f"data {source.description} (vocab {source.vocab_size})"
        self.loader = source
        self.whole_rows = getattr(source, "whole_rows", False) is True
        self.val_batches = []
        self.unigram = float(source.baseline_loss)
        self.tokenizer_file = self.tokenizer = None

    # Resume --------------------------------------------------------------------------------------------------
    def _resume_path(self) -> Path | None:
        return resume_checkpoint(self.out, self.cfg.resume)

    def _check_run_settings(self, path: Path) -> None:
        """Refuse to resume a run whose defining settings (RUN_KEYS) differ from this config's, naming the first."""
        saved, _ = saved_run_config(path)
        for key in RUN_KEYS:
            if key in saved and not same_setting(key, saved[key], getattr(self.cfg, key)):
                raise CheckpointError(f"cannot resume from {path}: it was trained with {key}={saved[key]!r}, this run "
                                      f"has {key}={getattr(self.cfg, key)!r} (`griffin train --out OUT --resume` "
                                      "reuses the run's settings)")

    def _layout(self, cfg: TrainConfig, source: BatchSource | None) -> Layout | None:
        """The device mesh of a tensor-parallel or sharded run (None: one process, or plain data parallelism)."""
        if not wants_layout(cfg):
            if cfg.dp_replicate not in (0, self.dist.world_size):
                raise ValueError(f"dp_replicate={cfg.dp_replicate} with tp=1 and dp_shard=1 must equal the world size "
                                 f"{self.dist.world_size}")
            extras = [k for k in ("sequence_parallel", "cpu_offload") if getattr(cfg, k)]
            if extras:
                raise ValueError(f"{', '.join(extras)} apply to a layout with tp > 1 or dp_shard > 1")
            # activation checkpointing without a layout: applied to the blocks once the model is built
            return None
        if source is not None:
            raise ValueError("a BatchSource trains in one process; tp and dp_shard need a prepared dataset")
        layout = Layout.create(cfg, self.dist.rank, self.dist.world_size, self.device, self.autocast,
                               self.model_config)
        self.dist = dataclasses.replace(self.dist, tp=layout.dims.tp, cp=layout.dims.cp)
        if not layout.autocast:  # FSDP's mixed-precision policy computes in bf16 instead
            self.autocast = None
        return layout

    def _check_resumable(self, state: dict[str, Any], path: Path) -> None:
        saved = state.get("config", {})
        for key in ("seq_len", "grad_accum", "seed"):
            if key in saved and saved[key] != getattr(self.cfg, key):
                raise CheckpointError(f"cannot resume from {path}: it was trained with {key}={saved[key]}, "
                                      f"this run has {key}={getattr(self.cfg, key)}")
        # the global batch must match; its split over data-parallel ranks may change (another layout)
        ranks = state.get("loader", {}).get("world_size", 1) if self.source is None else 1
        if "batch_size" in saved and saved["batch_size"] * ranks != self.cfg.batch_size * self.dist.dp_size:
            raise CheckpointError(f"cannot resume from {path}: it was trained with batch_size={saved['batch_size']} "
                                  f"on {ranks} data-parallel ranks, this run has batch_size={self.cfg.batch_size} on "
                                  f"{self.dist.dp_size} (the sequences per step must stay the same)")

    def _tensorboard(self):
        if not self.cfg.tensorboard:
            return None
        try:
            from torch.utils.tensorboard import SummaryWriter
        except ImportError:  # pragma: no cover - tensorboard is a dependency
            return None
        return SummaryWriter(str(self.out / "tensorboard"), purge_step=self.step + 1 if self.resumed_from else None)

    # Steps ---------------------------------------------------------------------------------------------------
    def _autocast(self):
        if self.autocast is None:
            return contextlib.nullcontext()
        return torch.autocast(self.device.type, dtype=self.autocast)

    def _shard(self, t: Tensor) -> Tensor:
        """This rank's contiguous shard of the sequences under context parallelism (``t`` itself without)."""
        return t if self.dist.cp == 1 else shard_sequence(t, self.dist.cp_rank, self.dist.cp)

    def _positions(self, batch) -> Tensor | None:
        """The batch's positions on the device; None for a source of whole rows (each row one document from 0: the
        model's own positions, plain causal attention), after checking that the batch is so."""
        if not self.whole_rows:
            return self._shard(batch.positions).to(self.device, non_blocking=True)
        B, T = batch.input_ids.shape
        if not torch.equal(batch.positions, torch.arange(T).expand(B, T)):
            raise ValueError(f"{type(self.source).__name__} says whole_rows (every row one document from position "
                             "0), but a batch's positions are not 0, 1, ..., seq_len - 1 in every row")
        return None

    def _loss_sum(self, batch) -> tuple[Tensor, Tensor]:
        ids = self._shard(batch.input_ids).to(self.device, non_blocking=True)
        positions = self._positions(batch)
        targets = self._shard(batch.targets).to(self.device, non_blocking=True)
        with self._autocast():
            # a source whose rows continue a state (griffin.synth.source's prefix stream) gives the cache they do
            cache = None
            if hasattr(self.source, "initial_cache"):  # (its advance compiled as the step is)
                compiled = isinstance(self.forward, CompiledStep) and self.forward.compiled
                cache = self.source.initial_cache(self.model, compile=compiled, fallback=self.cfg.compile_fallback)
            kwargs = {} if cache is None else {"cache": cache}
            loss = self.forward(ids, positions, targets=targets, loss_chunk=self.cfg.loss_chunk, **kwargs)
        return loss, (targets != IGNORE_INDEX).sum()

    def _check_compiles(self) -> None:
        """Compile the step's forward and backward once on a zero batch of the training shape, before any update: a
        model the compiler fails on is refused here (or, with compile_fallback, trained uncompiled)."""
        shape = (self.cfg.batch_size, self.cfg.seq_len // self.dist.cp)
        ids = torch.zeros(shape, dtype=torch.long, device=self.device)
        positions = torch.arange(shape[1], device=self.device).repeat(shape[0], 1)  # strided as a batch is
        if self.whole_rows:  # as the training batches: no positions
            positions = None
        with self._autocast():
            self.forward.check(ids, positions, targets=ids.clone(), loss_chunk=self.cfg.loss_chunk)
        if not self.forward.compiled:
            self._print("warning: --compile failed on this model; training uncompiled (--compile-fallback)")

    def train_step(self) -> dict[str, float]:
        """One optimizer update over ``grad_accum`` micro-batches; the loss is the mean over all their targets."""
        cfg = self.cfg
        batches = [next(self.loader) for _ in range(cfg.grad_accum)]
        local = sum(int((self._shard(b.targets) != IGNORE_INDEX).sum()) for b in batches)
        count = max(int(self.dist.sum(torch.tensor(local, device=self.device))), 1)
        # DDP (or FSDP, over dp × cp) averages gradients over ranks, so each rank scales its sum by the ranks averaged
        # over / (targets on all ranks); a cp rank's loss is over its shard's targets, the sum over cp the whole.
        scale = self.dist.dp_size * self.dist.cp / count
        total = torch.zeros((), device=self.device)
        for i, batch in enumerate(batches):
            sync = self.ddp is None or i == len(batches) - 1
            with contextlib.nullcontext() if sync else self.ddp.no_sync():
                loss, _ = self._loss_sum(batch)
                (loss * scale).backward()
            total += loss.detach()
        loss = self.dist.sum(total) / count
        clip = cfg.grad_clip if cfg.grad_clip > 0 else math.inf
        if self.layout is not None:  # the norm of the whole gradient across the shards
            grad_norm = self.layout.clip(self.model, clip)
        else:
            grad_norm = torch.nn.utils.clip_grad_norm_(self.model.parameters(), clip)
        lr = learning_rate(self.step, cfg)
        loss_value, norm_value = float(loss), float(grad_norm)
        finite = math.isfinite(loss_value) and math.isfinite(norm_value)
        if finite:
            for group in self.optimizer.param_groups:
                group["lr"] = lr
            self.optimizer.step()
            self.skipped = 0
        self.optimizer.zero_grad(set_to_none=True)
        if not finite:
            self._non_finite(loss_value, norm_value)
        self.step += 1
        self.tokens += sum(b.input_ids.numel() for b in batches) * self.dist.dp_size
        return {"loss": loss_value, "grad_norm": norm_value, "lr": lr, "skipped": not finite}

    def _non_finite(self, loss: float, norm: float) -> None:
        where = f"step {self.step + 1}: loss={loss}, gradient norm={norm}"
        last = find_resumable(self.ckpt_root)
        if self.cfg.on_nan == "stop":
            raise TrainingError(f"non-finite {where}; stopped before updating the weights. The last checkpoint "
                                f"({last or 'none'}) is intact; lower the learning rate or use --on-nan skip.")
        self.skipped += 1
        if self.skipped > self.cfg.max_skips:
            raise TrainingError(f"non-finite {where}: {self.skipped} consecutive updates skipped "
                                f"(max_skips={self.cfg.max_skips}); the last checkpoint ({last or 'none'}) is intact.")
        self._print(f"warning: non-finite {where}; update skipped ({self.skipped} in a row)")

    @torch.no_grad()
    def evaluate(self) -> float:
        """Mean loss per target token over the fixed validation batches (with a source: its ``val_loss``, and its
        other metrics in ``eval_metrics``)."""
        self.model.eval()
        if self.source is not None:
            try:
                with self._autocast():
                    metrics = {k: float(v) for k, v in self.source.evaluate(self.model).items()}
            finally:
                self.model.train()
            if "val_loss" not in metrics:
                raise ValueError(f"{type(self.source).__name__}.evaluate returned no 'val_loss': {sorted(metrics)}")
            self.eval_metrics = {k: v for k, v in metrics.items() if k != "val_loss"}
            return metrics["val_loss"]
        sums = torch.zeros(2, dtype=torch.float64, device=self.device)
        for batch in self.val_batches:
            loss, n = self._loss_sum(batch)
            sums += torch.stack([loss.double(), n.double()])
        if self.examples and self.cfg.eval_examples and self.layout is None and self.dist.is_main:
            self._score_replies()
        self.model.train()
        total, count = self.dist.sum(sums).tolist()
        return total / max(count, 1.0)

    def _score_replies(self) -> None:
        """Greedy replies to held-out examples: their exact-match accuracy (in ``eval_metrics``) and the first one
        (``eval_sample``), shown at every evaluation."""
        from griffin.finetune.evaluate import exact_match

        with self._autocast():
            scored = exact_match(self.model, self.val_examples, self.cfg.eval_examples)
        if scored is None:
            return
        self.eval_metrics = {"exact_match": scored.accuracy}
        decode = self.tokenizer.decode
        reference = "" if scored.reply == scored.reference else f"  [reference: {decode(scored.reference)!r}]"
        text = f"{decode(scored.prompt)}{decode(scored.reply)}{reference}"
        self.eval_sample = text.encode("utf-8", "surrogateescape").decode("utf-8", "replace")  # bytes cut mid-character

    # Checkpoints ---------------------------------------------------------------------------------------------
    def save(self, val_loss: float | None, track_best: bool = True) -> Path:
        """Write the checkpoint of this step; ``val_loss``: this step's validation loss (None: not evaluated here).
        ``track_best=False`` (a checkpoint written on a stop request) leaves the best checkpoint as it was, as a run
        that did not stop has it."""
        if track_best and val_loss is not None and val_loss < self.best_val:
            self.best_val, self.best_step = val_loss, self.step
        state = {"tokens": self.tokens, "val_loss": val_loss, "best_val_loss": self.best_val,
                 "best_step": self.best_step, "loader": self.loader.state_dict(), "config": self.cfg.to_dict(),
                 "data": str(self.data_dir) if self.source is None else self.source.description,
                 "tokenizer": self.meta["tokenizer"]}
        extra = {}
        if self.tokenizer_file is not None:
            name = "tokenizer.model" if self.tokenizer_file.suffix == ".model" else "tokenizer.json"
            extra[name] = self.tokenizer_file
        if self.examples and (self.data_dir / TEMPLATE_FILE).is_file():  # the chats' template, for griffin serve
            extra[TEMPLATE_FILE] = self.data_dir / TEMPLATE_FILE
        source_tensors = self.source.state_tensors() if hasattr(self.source, "state_tensors") else {}
        if source_tensors:  # (a source trains in one process) copied into the checkpoint, then removed
            extra[SOURCE_STATE] = self.out / f".{SOURCE_STATE}"
            write_safetensors(extra[SOURCE_STATE], source_tensors, {"library": "griffin"})
        try:
            return self._save(state, extra)
        finally:
            if SOURCE_STATE in extra:
                extra[SOURCE_STATE].unlink(missing_ok=True)

    def _save(self, state: dict[str, Any], extra: dict[str, Path]) -> Path:
        path = step_dir(self.ckpt_root, self.step)
        if self.layout is not None:  # every rank writes its shards; the step appears once all have
            self.layout.save(path, self.model, self.optimizer, {**state, "step": self.step}, extra)
        if self.dist.is_main:  # every rank holds the same weights and optimizer state
            if self.layout is None:
                # the base named as given (a `best` link outlives the step it points to, which may be pruned)
                write = functools.partial(write_lora, base=str(Path(self.cfg.init).absolute())) \
                    if self.cfg.lora_rank else None
                save_checkpoint(self.ckpt_root, self.step, self.model, self.optimizer, state, extra, write)
            else:
                set_link(self.ckpt_root, "latest", path)
            best = step_dir(self.ckpt_root, self.best_step) if self.best_step is not None else None
            if best is not None and best.is_dir():
                set_link(self.ckpt_root, "best", best)
            prune(self.ckpt_root, self.cfg.keep_last, keep=(best,) if best is not None and best.is_dir() else ())
        self.dist.barrier()
        return path

    # The loop ------------------------------------------------------------------------------------------------
    def _print(self, text: str) -> None:
        if not self.dist.is_main:
            return
        if self._bar is not None:
            self._bar.write(text)
        else:
            print(text, flush=True)

    def _record(self, kind: str, **values: Any) -> None:
        if self.log is None:
            return
        self.log.write({"kind": kind, "step": self.step, **values,
                        "wall_s": round(time.perf_counter() - self.started, 3)})
        if self.writer is not None:
            for key, value in values.items():
                if isinstance(value, (int, float)) and not isinstance(value, bool):
                    self.writer.add_scalar(f"{kind}/{key}", value, self.step)

    def _stop_reason(self, stop: Any, asked: Callable[[], bool] | None) -> str | None:
        """Why to stop now (None: go on): ``asked()``, agreed over the ranks by a MAX all-reduce, so that one rank's
        request stops them all at the same step."""
        if asked is None:
            return None
        here = bool(asked())
        agreed = here
        if self.dist.enabled:
            import torch.distributed as dist

            flag = torch.tensor(int(here), device=self.device)
            dist.all_reduce(flag, op=dist.ReduceOp.MAX)
            agreed = bool(flag.item())
        if not agreed:
            return None
        return (getattr(stop, "reason", None) or "a stop request") if here else "a stop request on another rank"

    def _stopped(self, reason: str, checkpoint: Path | None) -> TrainingStopped:
        self._record("stop", reason=reason, checkpoint=str(checkpoint) if checkpoint is not None else None)
        return TrainingStopped(reason, self.step, checkpoint, self.out)

    def run(self, stop: StopRequest | threading.Event | Callable[[], bool] | None = None) -> TrainResult:
        """Train to ``max_steps``. ``stop`` (a :class:`StopRequest`, a ``threading.Event`` or a callable returning
        True once the run should stop; every rank passes one or none) is looked at before the first step and after
        each optimizer step: once set, the checkpoint of that step is written (unless it already is: a periodic
        one, the one resumed from) without another evaluation, the best checkpoint left as it was, and
        :class:`TrainingStopped` is raised. A run at ``max_steps`` finishes as usual."""
        cfg = self.cfg
        if stop is not None and not callable(stop) and not callable(getattr(stop, "is_set", None)):
            raise TypeError(f"stop must be a StopRequest, a threading.Event or a callable, got {type(stop).__name__}")
        asked = stop.is_set if stop is not None and hasattr(stop, "is_set") else stop
        n_params = self.model.num_parameters()
        if cfg.lora_rank:
            trainable = sum(p.numel() for p in self.model.parameters() if p.requires_grad)
            self._print(f"LoRA rank {cfg.lora_rank} (alpha {cfg.lora_alpha:g}) on {len(self.lora_modules)} projections "
                        f"of {cfg.init}: {trainable:,} trainable parameters, the model's {n_params - trainable:,} "
                        f"frozen in {cfg.base_dtype}")
        self._print(f"griffin train: {self.model_config.family} {n_params:,} parameters "
                    f"({self.model_config.depth} blocks, width {self.model_config.width}) on {self.device}"
                    f"{', bf16 autocast' if self.autocast else ', fp32'}"
                    f"{' (float32 logits)' if getattr(self.model.loss, 'float32_logits', False) else ''}; "
                    f"{self.data_line}; "
                    f"unigram baseline {self.unigram:.3f} nats/token; {self.flops_per_token / 1e6:.1f} MFLOPs per "
                    f"training token, MFU against {self.peak_flops / 1e9:,.0f} GFLOP/s ({self.peak_source})")
        if self.layout is not None:
            self._print(self.layout.describe(cfg.batch_size))
        elif self.dist.enabled:
            self._print(f"data parallel over {self.dist.world_size} processes ({cfg.batch_size} sequences each)")
        if self.resumed_from:
            self._print(f"resumed from {self.resumed_from} at step {self.step}")
        self._record("start", parameters=n_params, device=str(self.device), flops_per_token=self.flops_per_token,
                     peak_flops=self.peak_flops, peak_source=self.peak_source, unigram_loss=self.unigram,
                     config=cfg.to_dict())
        val_loss = math.nan
        last_ckpt = None
        rate = 0.0
        bar = _progress(cfg, self.step) if self.dist.is_main else None
        self._bar = bar
        try:
            if self.step < cfg.max_steps and (reason := self._stop_reason(stop, asked)):  # before the first step
                raise self._stopped(reason, self.resumed_from)
            if isinstance(self.forward, CompiledStep) and self.step < cfg.max_steps:
                self._check_compiles()
            if self.step == 0:  # the starting point of the validation curve
                val_loss = self.evaluate()
                self._record("eval", val_loss=val_loss, val_ppl=math.exp(min(val_loss, 50.0)), **self.eval_metrics,
                             **({"sample": self.eval_sample} if self.eval_sample else {}))
                if self.eval_metrics or self.eval_sample:
                    extra = "".join(f", {k} {v:.4f}" for k, v in self.eval_metrics.items())
                    self._print(f"step      0: val loss {val_loss:.4f} (unigram {self.unigram:.4f}){extra}")
                if self.eval_sample:
                    self._print(f"  held-out reply: {self.eval_sample[-300:]!r}")
            window_start, window_tokens = time.perf_counter(), self.tokens
            while self.step < cfg.max_steps:
                metrics = self.train_step()
                elapsed = time.perf_counter() - window_start
                rate = (self.tokens - window_tokens) / max(elapsed, 1e-9)
                if bar is not None:
                    bar.update(1)
                    shown = {"loss": f"{metrics['loss']:.3f}", "tok/s": f"{rate:,.0f}"}
                    if not math.isnan(val_loss):
                        shown["val"] = f"{val_loss:.3f}"
                    bar.set_postfix(shown)
                if self.step % cfg.log_interval == 0 or self.step == cfg.max_steps:
                    mfu = rate * self.flops_per_token / self.peak_flops
                    self._record("train", loss=metrics["loss"], lr=metrics["lr"], grad_norm=metrics["grad_norm"],
                                 tokens=self.tokens, tokens_per_s=rate, mfu=mfu)
                    window_start, window_tokens = time.perf_counter(), self.tokens
                is_ckpt = self.step % cfg.ckpt_interval == 0 or self.step == cfg.max_steps
                if self.step % cfg.eval_interval == 0 or is_ckpt:
                    val_loss = self.evaluate()
                    self._record("eval", val_loss=val_loss, val_ppl=math.exp(min(val_loss, 50.0)), **self.eval_metrics,
                                 **({"sample": self.eval_sample} if self.eval_sample else {}))
                    mfu = rate * self.flops_per_token / self.peak_flops
                    extra = "".join(f", {k} {v:.4f}" for k, v in self.eval_metrics.items())
                    self._print(f"step {self.step:>6}: val loss {val_loss:.4f} (unigram {self.unigram:.4f}){extra}, "
                                f"train loss {metrics['loss']:.4f}, {rate:,.0f} tokens/s, MFU {mfu:.1%}")
                    if self.eval_sample:
                        self._print(f"  held-out reply: {self.eval_sample[-300:]!r}")
                if is_ckpt:
                    last_ckpt = self.save(val_loss)
                    window_start, window_tokens = time.perf_counter(), self.tokens
                if self.step < cfg.max_steps and (reason := self._stop_reason(stop, asked)):
                    if not is_ckpt:  # as a periodic checkpoint, but neither evaluated nor a candidate for `best`
                        evaluated = self.step % cfg.eval_interval == 0
                        last_ckpt = self.save(val_loss if evaluated else None, track_best=False)
                    raise self._stopped(reason, last_ckpt)
        finally:
            if bar is not None:
                bar.close()
            self._bar = None
            if self.writer is not None:
                self.writer.close()
        if last_ckpt is None:  # nothing left to do: resumed at max_steps
            last_ckpt = find_resumable(self.ckpt_root)
            val_loss = self.evaluate()
        history, sample = [], ""
        # a laid-out model is gathered whole on rank 0 to sample from (a collective: every rank takes part)
        whole = self.layout.gather(self.model) if self.layout is not None and self.cfg.sample_tokens else None
        if self.dist.is_main:
            history = self.log.records()
            plot_losses(history, self.unigram, self.out / "loss.png")
            sample = self.sample(whole)
            self._record("end", val_loss=val_loss, best_val_loss=self.best_val, sample=sample)
        return TrainResult(self.step, val_loss, self.best_val, self.unigram, rate, self.out, last_ckpt, sample,
                           history)

    def sample(self, model: CausalLM | None = None) -> str:
        """A continuation of ``sample_prompt`` from the trained model (seeded, so it is reproducible); ``model``:
        the whole model gathered from a laid-out run."""
        if self.examples:  # the held-out example's reply, as at every evaluation
            if self.eval_sample:
                (self.out / "sample.txt").write_text(self.eval_sample.encode("utf-8", "replace").decode("utf-8"))
            return self.eval_sample
        if not self.cfg.sample_tokens or not self.cfg.sample_prompt or self.tokenizer is None:
            return ""
        tokenizer = self.tokenizer
        ids = ([tokenizer.bos_id] if tokenizer.bos_id is not None else []) + tokenizer.encode(self.cfg.sample_prompt)
        model = self.model if model is None else model.to(self.device)
        model.eval()
        out = generate(model, torch.tensor([ids], device=self.device), self.cfg.sample_tokens,
                       temperature=self.cfg.sample_temperature, seed=self.cfg.seed,
                       stop_tokens=[tokenizer.eos_id] if tokenizer.eos_id is not None else ())
        model.train()
        text = self.cfg.sample_prompt + tokenizer.decode(out[0])
        (self.out / "sample.txt").write_text(text.encode("utf-8", "replace").decode("utf-8"))
        return text


def _progress(cfg: TrainConfig, initial: int):
    if not cfg.progress:
        return None
    from tqdm.auto import tqdm

    return tqdm(total=cfg.max_steps, initial=initial, unit="step", dynamic_ncols=True, desc="train")


def plot_losses(history: list[dict[str, Any]], unigram: float, path: Path) -> None:
    """Training and validation loss against tokens seen, with the unigram baseline (a PNG)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    train = [(r["tokens"], r["loss"]) for r in history if r["kind"] == "train"]
    tokens_at = {r["step"]: r["tokens"] for r in history if r["kind"] == "train"}
    tokens_at[0] = 0
    val = [(tokens_at.get(r["step"], math.nan), r["val_loss"]) for r in history if r["kind"] == "eval"]
    fig, ax = plt.subplots(figsize=(6.4, 4.0), dpi=120)
    if train:
        ax.plot(*zip(*train, strict=True), label="train", lw=1.0, alpha=0.8)
    if val:
        ax.plot(*zip(*val, strict=True), "o-", label="validation", lw=1.5, ms=3)
    ax.axhline(unigram, ls="--", color="gray", label=f"unigram baseline ({unigram:.2f})")
    ax.set_xlabel("training tokens")
    ax.set_ylabel("loss (nats / token)")
    ax.legend()
    ax.grid(alpha=0.3)
    fig.tight_layout()
    try:
        atomic_write(path, lambda tmp: fig.savefig(tmp, format="png"))
    finally:
        plt.close(fig)


def train(cfg: TrainConfig, stop: StopRequest | threading.Event | Callable[[], bool] | None = None) -> TrainResult:
    """Run (or resume) the training run described by ``cfg``; ``stop``: ends it early with a checkpoint, raising
    :class:`TrainingStopped` (see :meth:`Trainer.run`)."""
    return Trainer(cfg).run(stop)

