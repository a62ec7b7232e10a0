"""Training configuration: one typed dataclass, read from TOML, overridden from the command line.

Precedence: the defaults below (the README's CPU demo) < a TOML file (``griffin train --config F``) < command-line
flags. Unknown keys and values of the wrong type are refused before anything runs, with the key named.

Resuming (``griffin train --out OUT --resume``) starts from the run's saved configuration instead of the defaults:
settings given again that define the run (:data:`RUN_KEYS`) must agree with it, the others (more steps, other
logging intervals) may change, and the machine's (:data:`MACHINE_KEYS`: device, threads, layout) come from this
run's own flags; see :meth:`TrainConfig.resuming`. ``griffin train --resume`` needs a checkpoint in OUT (a mistyped
``--out`` is refused, not trained from scratch); ``--resume if-any`` (``resume = "if-any"``) starts a new run when
there is none. The library's :func:`~griffin.training.train` starts a new run for either.
"""

from __future__ import annotations

import dataclasses
import difflib
import functools
import json
import math
import sys
import types
import typing
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from griffin.config import PRESETS, ModelConfig
from griffin.data import VAL_FRACTION
from griffin.data.examples import LOSS_ON

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover
    import tomli as tomllib


INIT_OVERRIDES = ("attention_window",)
"""The ModelConfig fields a fine-tune (``--init``) may override: no weight depends on them."""
PRECISIONS = ("auto", "fp32", "bf16")
"""The trainer's compute precision (``TrainConfig.precision``)."""


def _opt(default: Any, help: str, **kw: Any) -> Any:
    return field(default=default, metadata={"help": help, **kw})


@dataclass
class TrainConfig:
    """Everything a training run needs; each field is also a ``griffin train --flag``."""

    # Model
    preset: str = _opt("griffin-cpu", "model preset (see `griffin presets`)")
    model: dict[str, Any] = field(default_factory=dict, metadata={
        "help": "ModelConfig fields overriding the preset, e.g. width=256 depth=8 (TOML: a [model] table); "
                "vocab_size defaults to the data's tokenizer"})
    init: str = _opt("", "fine-tune: start from this checkpoint (griffin, HF RecurrentGemma or official .pt), with "
                         "its config and tokenizer, instead of a new model (preset and --model do not apply, but for "
                         "--model attention_window=N)")
    # Fine-tuning (docs/finetuning.md)
    lora_rank: int = _opt(0, "with --init: train LoRA adapters of this rank on the frozen model (0: train every "
                             "weight)")
    lora_alpha: float = _opt(16.0, "LoRA alpha: the adapters' update is scaled by alpha / rank")
    lora_dropout: float = _opt(0.0, "dropout on the LoRA adapters' input")
    lora_targets: str = _opt("all", "projections that get LoRA adapters: all, attention, mlp, recurrent, or names "
                                    "(q_proj, k_proj, v_proj, o_proj, gate_proj, up_proj, down_proj, linear_x, "
                                    "linear_y, linear_out), comma-separated; the RG-LRU gates get none")
    base_dtype: str = _opt("float32", "with LoRA: dtype of the frozen model (bfloat16 halves its memory; the "
                                      "adapters stay float32)", choices=("float32", "bfloat16"))
    loss_on: str = _opt("response", "examples (JSONL chats, prompt/completion pairs): the loss on the replies only "
                                    "('response') or on every token ('all')", choices=LOSS_ON)
    chat_template: str = _opt("auto", "how chats are rendered: 'auto' (the --init checkpoint's template, from its "
                                      "tokenizer_config.json or chat_template.jinja), 'plain' (griffin's <|role|> "
                                      "template) or a .jinja file")
    truncate: bool = _opt(False, "cut examples longer than seq_len (and count them) instead of refusing them")
    eval_examples: int = _opt(32, "examples: held-out replies generated greedily at each evaluation, scored by exact "
                                  "match (0: none)")
    val_data: str = _opt("", "examples to evaluate on (JSONL files, comma-separated); default: val_fraction of "
                             "--data's examples held out")
    # Data
    data: str = _opt("", "a dataset prepared by `griffin prepare`, or text/JSONL/parquet files or directories to "
                         "prepare into OUT/data; JSONL chats or prompt/completion pairs (any JSONL with --init) are "
                         "examples, packed whole; empty: the embedded corpus (the Python standard library's source)")
    tokenizer: str = _opt("bytes", "tokenizer used when the data must be prepared: 'bytes', a tokenizer.json or a "
                                   "SentencePiece .model")
    val_fraction: float = _opt(VAL_FRACTION, "fraction of documents held out for validation when preparing data")
    seq_len: int = _opt(256, "tokens per training sequence (documents are packed; the model resets at each start)")
    batch_size: int = _opt(16, "sequences per micro-batch")
    grad_accum: int = _opt(1, "micro-batches accumulated per optimizer step")
    # Optimisation (Section 3: AdamW)
    lr: float = _opt(3e-3, "peak learning rate")
    min_lr_ratio: float = _opt(0.1, "final learning rate as a fraction of the peak (cosine decay)")
    warmup_steps: int = _opt(30, "steps of linear warm-up from 0 to the peak learning rate")
    max_steps: int = _opt(300, "optimizer steps in the whole run (the cosine schedule ends here)")
    weight_decay: float = _opt(0.1, "AdamW weight decay (never on norms, biases or the RG-LRU decay parameter)")
    beta1: float = _opt(0.9, "AdamW beta1")
    beta2: float = _opt(0.95, "AdamW beta2")
    adam_eps: float = _opt(1e-8, "AdamW epsilon")
    grad_clip: float = _opt(1.0, "clip the global gradient norm to this value (0: no clipping)")
    # Hardware
    device: str = _opt("auto", "'auto' (CUDA if available), 'cpu', 'cuda', 'cuda:1', ...")
    precision: str = _opt("auto", "'auto' (bf16 autocast where supported on CUDA, else fp32), 'fp32' or 'bf16'",
                          choices=PRECISIONS)
    logits_precision: str = _opt("auto", "under bf16 autocast, the output layer's logits and the loss: 'fp32' (from "
                                         "the float32 weights: the logits are not rounded to bf16's 8 bits), 'bf16' "
                                         "(autocast's matmul), 'auto' (fp32 on CPU, bf16 on CUDA)",
                                 choices=PRECISIONS)
    compile: bool = _opt(False, "the fast step: torch.compile the model and update with the fused AdamW "
                                "(griffin.training.fast); refused where it cannot run, see compile_fallback")
    compile_fallback: bool = _opt(False, "where --compile cannot run (the compiler fails on the model, bf16 on a CPU "
                                         "without a bf16 matmul), train the uncompiled step (in fp32 for the "
                                         "latter) with a warning instead of refusing")
    loss_chunk: int = _opt(0, "rows of logits at a time in the loss (0: all at once); e.g. 4096 for a large "
                              "vocabulary, whose (tokens, vocab) logits would not fit")
    threads: int = _opt(0, "CPU threads for torch (0: torch's default)")
    # Scale-out (Section 4.1; docs/distributed.md): under torchrun, dp_replicate x dp_shard x tp = the processes
    tp: int = _opt(1, "tensor-parallel devices per model replica (Megatron: MLP, recurrent block, attention heads and "
                      "vocabulary split)")
    dp_shard: int = _opt(1, "data-parallel devices that shard parameters, gradients and AdamW states (ZeRO-3, FSDP2)")
    dp_replicate: int = _opt(0, "data-parallel replicas of the (sharded) model; 0: the processes tp and dp_shard "
                                "leave (with tp = dp_shard = 1: plain DistributedDataParallel, as without these flags)")
    cp: int = _opt(1, "context-parallel devices: each sequence split into cp contiguous shards, one per device, for "
                      "sequences longer than one device holds (the RG-LRU carry, the Conv1D halo and attention's "
                      "keys and values exchanged; seq_len must be a multiple of cp)")
    sequence_parallel: bool = _opt(False, "with tp > 1: split the norms and the residual stream along the sequence")
    activation_checkpointing: bool = _opt(False, "recompute each residual block in the backward pass (less memory)")
    cpu_offload: bool = _opt(False, "with dp_shard or dp_replicate > 1: keep FSDP's sharded state in CPU memory")
    # Evaluation, logging, checkpoints
    eval_interval: int = _opt(50, "evaluate on the validation split every N steps (and at the end)")
    eval_batches: int = _opt(8, "validation batches per evaluation (fixed, the same each time)")
    log_interval: int = _opt(10, "write a training-loss record every N steps")
    ckpt_interval: int = _opt(100, "write a checkpoint every N steps (and at the end)")
    keep_last: int = _opt(2, "checkpoints kept besides the best one")
    out: str = _opt("runs/griffin-cpu", "output directory: checkpoints, logs, TensorBoard events, plots")
    resume: str = _opt("", "'auto': continue from the newest valid checkpoint in OUT, which must hold one; "
                           "'if-any': the same, or start a new run if OUT holds no checkpoint yet (a requeued cluster "
                           "job that always runs the same command); or a checkpoint directory")
    seed: int = _opt(0, "seed of the initialisation, the data order and the sample")
    on_nan: str = _opt("stop", "on a non-finite loss or gradient: 'stop' (raise) or 'skip' the update",
                       choices=("stop", "skip"))
    max_skips: int = _opt(5, "with on_nan='skip': stop after this many consecutive skipped steps")
    tensorboard: bool = _opt(True, "write TensorBoard events to OUT/tensorboard")
    progress: bool = _opt(True, "show a progress bar")
    # The sample printed at the end
    sample_prompt: str = _opt("def ", "prompt of the sample generated at the end ('' for none)")
    sample_tokens: int = _opt(200, "tokens sampled at the end (0: no sample)")
    sample_temperature: float = _opt(0.8, "temperature of the final sample")

    def __post_init__(self) -> None:
        self.validate()

    # Validation ---------------------------------------------------------------------------------
    def validate(self) -> None:
        """Raise a ValueError naming the first field whose value cannot run."""
        types_ = field_types()
        for f in dataclasses.fields(self):
            check_type(f.name, getattr(self, f.name), types_[f.name])
            choices = f.metadata.get("choices")
            if choices and getattr(self, f.name) not in choices:
                raise ValueError(f"{f.name}={getattr(self, f.name)!r} must be one of {choices}")
            if types_[f.name] is float:
                setattr(self, f.name, float(getattr(self, f.name)))
        for f in dataclasses.fields(self):
            if types_[f.name] is float and not math.isfinite(getattr(self, f.name)):
                raise ValueError(f"{f.name}={getattr(self, f.name)} must be a finite number")
        positive = ("seq_len", "batch_size", "grad_accum", "max_steps", "eval_interval", "eval_batches",
                    "log_interval", "ckpt_interval", "max_skips")
        for key in positive:
            if getattr(self, key) <= 0:
                raise ValueError(f"{key}={getattr(self, key)} must be a positive integer")
        for key in ("tp", "dp_shard", "cp"):
            if getattr(self, key) < 1:
                raise ValueError(f"{key}={getattr(self, key)} must be a positive integer")
        if self.seq_len % self.cp:
            raise ValueError(f"context parallelism splits seq_len={self.seq_len} over cp={self.cp} devices: it must "
                             "be a multiple of cp")
        for key in ("warmup_steps", "keep_last", "threads", "sample_tokens", "loss_chunk", "dp_replicate", "lora_rank",
                    "eval_examples"):
            if getattr(self, key) < 0:
                raise ValueError(f"{key}={getattr(self, key)} must be >= 0")
        if not self.lr > 0:
            raise ValueError(f"lr={self.lr} must be positive")
        for key in ("min_lr_ratio", "beta1", "beta2"):
            if not 0.0 <= getattr(self, key) <= 1.0:
                raise ValueError(f"{key}={getattr(self, key)} must lie in [0, 1]")
        for key in ("weight_decay", "grad_clip", "adam_eps", "sample_temperature"):
            if not getattr(self, key) >= 0:
                raise ValueError(f"{key}={getattr(self, key)} must be >= 0")
        if self.lora_rank and not self.init:
            raise ValueError(f"lora_rank={self.lora_rank}: LoRA adapts a pretrained model; give it with --init")
        if self.lora_rank and (self.tp > 1 or self.dp_shard > 1 or self.cp > 1):
            raise ValueError(f"lora_rank={self.lora_rank} with tp={self.tp}, dp_shard={self.dp_shard}, cp={self.cp}: "
                             "LoRA trains in "
                             "one process or data-parallel (DistributedDataParallel under torchrun); tp and dp_shard "
                             "lay out a full fine-tune (--lora-rank 0)")
        if self.init and set(self.model) - set(INIT_OVERRIDES):
            raise ValueError(f"--model {', '.join(sorted(set(self.model) - set(INIT_OVERRIDES)))}: a fine-tune "
                             "(--init) keeps the checkpoint's model config (it may change only "
                             f"{', '.join(INIT_OVERRIDES)}, which no weight depends on)")
        if not self.lora_alpha > 0:
            raise ValueError(f"lora_alpha={self.lora_alpha} must be positive")
        if not 0.0 <= self.lora_dropout < 1.0:
            raise ValueError(f"lora_dropout={self.lora_dropout} must lie in [0, 1)")
        if self.chat_template not in ("auto", "plain") and not Path(self.chat_template).is_file():
            raise ValueError(f"chat_template={self.chat_template!r}: no such file (use 'auto', 'plain' or a .jinja "
                             "file)")
        if not 0.0 < self.val_fraction < 1.0:
            raise ValueError(f"val_fraction={self.val_fraction} must lie in (0, 1)")
        if self.device != "auto":
            try:
                torch.device(self.device)
            except RuntimeError:
                raise ValueError(f"device={self.device!r} is not a device: use 'auto', 'cpu', 'cuda', 'cuda:N' or "
                                 "another torch device name") from None
        if self.preset not in PRESETS:
            close = difflib.get_close_matches(self.preset, PRESETS, n=3)
            raise ValueError(f"unknown preset {self.preset!r}" + (f"; did you mean {close}?" if close else
                                                                  "; see `griffin presets`"))
        fields = {f.name for f in dataclasses.fields(ModelConfig)}
        for key in self.model:
            if key not in fields:
                close = difflib.get_close_matches(key, fields, n=3)
                raise ValueError(f"unknown model key {key!r}" + (f"; did you mean {close}?" if close else ""))
        try:  # the model the preset and overrides describe (no weights): its bad values before any data work
            self.model_config()
        except (ValueError, TypeError) as err:
            raise ValueError(f"model: {err}") from None

    def model_config(self, vocab_size: int | None = None) -> ModelConfig:
        """The preset with the [model] overrides; vocab_size follows the data unless set explicitly."""
        overrides = dict(self.model)
        if vocab_size is not None and "vocab_size" not in overrides:
            overrides["vocab_size"] = vocab_size
        for key in ("block_types", "a_init_range"):
            if isinstance(overrides.get(key), list):  # TOML arrays; anything else is left to ModelConfig to refuse
                overrides[key] = tuple(overrides[key])
        if ("depth" in overrides or "family" in overrides) and "block_types" not in overrides:
            overrides["block_types"] = None  # re-derived from the family's pattern for the new depth
        return ModelConfig.from_preset(self.preset, **overrides)

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    # Construction -------------------------------------------------------------------------------
    @classmethod
    def from_dict(cls, data: dict[str, Any], source: str = "config") -> TrainConfig:
        """Build from a mapping, refusing unknown keys (with suggestions) before anything else."""
        names = [f.name for f in dataclasses.fields(cls)]
        for key in data:
            if key not in names:
                close = difflib.get_close_matches(key, names, n=3)
                hint = f"; did you mean {close}?" if close else f"; valid keys: {', '.join(names)}"
                raise ValueError(f"{source}: unknown key {key!r}{hint}")
        return cls(**data)

    @classmethod
    def from_toml(cls, path: str | Path, **overrides: Any) -> TrainConfig:
        """The config file at ``path`` with ``overrides`` (flags) on top; its [model] table merges key by key."""
        return cls.from_dict(merge_settings(read_toml(path), overrides), source=str(path))

    @classmethod
    def resuming(cls, saved: dict[str, Any], given: dict[str, Any], trained_model: dict[str, Any] | None = None,
                 source: str = "the run") -> TrainConfig:
        """The configuration of a resumed run: ``saved`` (the run's own, from its checkpoint's ``trainer.json``) with
        the settings ``given`` again (flags, config file) on top. A given setting that defines the run
        (:data:`RUN_KEYS`) must agree with the saved one, else a ValueError names the flag and both values; a
        ``model`` key given again is compared with ``trained_model`` (the checkpoint's ``config.json``)."""
        names = {f.name for f in dataclasses.fields(cls)}
        # a key an older version saved is dropped; the machine's settings (device, threads, layout) are not inherited
        base = {k: v for k, v in saved.items() if k in names and k not in MACHINE_KEYS}
        given = dict(given)
        model = given.pop("model", None) or {}
        for key in RUN_KEYS:
            if key in given and key in base and not same_setting(key, given[key], base[key]):
                raise ValueError(f"cannot resume {source}: {_flag(key)} {given[key]!r} disagrees with the run's "
                                 f"{key}={base[key]!r}; leave it out to continue with the run's value, or start a new "
                                 "run in another --out")
        known = {**(trained_model or {}), **base.get("model", {})}
        for key, value in model.items():
            if key not in known:
                raise ValueError(f"cannot resume {source}: --model {key}={value!r} is not a setting of the run's "
                                 "model" + _suggest(key, known))
            if not same_setting(key, value, known[key]):
                raise ValueError(f"cannot resume {source}: --model {key}={value!r} disagrees with the run's "
                                 f"{key}={known[key]!r}; leave it out to continue with the run's value")
        return cls.from_dict({**base, **given}, source=source)


#: The settings that define a run: given again on resuming, they must agree with the run's saved values. The others
#: may change (``max_steps`` to train on, the device and layout, intervals, sampling); ``batch_size`` is checked by
#: the trainer as the global batch, which may be split over another number of data-parallel ranks.
RUN_KEYS = ("preset", "model", "data", "tokenizer", "val_fraction", "seq_len", "grad_accum", "lr", "min_lr_ratio",
            "warmup_steps", "weight_decay", "beta1", "beta2", "adam_eps", "grad_clip", "seed", "init", "lora_rank",
            "lora_alpha", "lora_dropout", "lora_targets", "loss_on", "chat_template", "truncate", "val_data")


#: Settings of the machine a run happens to use, not of the run: a resumed run takes them from its own flags (or the
#: defaults), so that a run saved on 4 processes with tp = 2 resumes on one process without repeating them.
MACHINE_KEYS = ("device", "threads", "tp", "dp_shard", "dp_replicate", "cp", "sequence_parallel",
                "activation_checkpointing", "cpu_offload")


def _flag(key: str) -> str:
    return "--" + key.replace("_", "-")


def _suggest(key: str, names: Any) -> str:
    close = difflib.get_close_matches(key, list(names), n=3)
    return f"; did you mean {close}?" if close else ""


def same_setting(key: str, a: Any, b: Any) -> bool:
    """Whether two values of a setting mean the same (numbers by value, lists and tuples alike, paths resolved)."""
    if key in ("data", "val_data", "init", "chat_template") and isinstance(a, str) and isinstance(b, str):
        def paths(text: str) -> list[str]:
            return [str(Path(p).resolve()) for p in text.split(",")] if text else []
        return a == b or paths(a) == paths(b)
    if isinstance(a, (list, tuple)) and isinstance(b, (list, tuple)):
        return len(a) == len(b) and all(same_setting(key, x, y) for x, y in zip(a, b, strict=True))
    if isinstance(a, bool) or isinstance(b, bool):
        return a is b
    if isinstance(a, (int, float)) and isinstance(b, (int, float)):
        return float(a) == float(b)
    return a == b


def read_toml(path: str | Path) -> dict[str, Any]:
    """The settings of a training config file (its [model] table as ``model``), with the file named in errors."""
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"no training config at {path}")
    try:
        data = tomllib.loads(path.read_text())
    except tomllib.TOMLDecodeError as err:
        raise ValueError(f"{path}: not valid TOML: {err}") from None
    except UnicodeDecodeError as err:
        raise ValueError(f"{path}: not a text file: {err}") from None
    if not isinstance(data.get("model", {}), dict):
        raise ValueError(f"{path}: model must be a [model] table, got {data['model']!r}")
    return data


def toml_value(value: Any) -> str:
    """One value in TOML: strings (JSON's escapes are TOML's), booleans, integers, finite floats and arrays of these."""
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, int):
        return str(value)
    if isinstance(value, float):
        if not math.isfinite(value):
            raise ValueError(f"{value} cannot be written to TOML (not finite)")
        return repr(value)
    if isinstance(value, str):  # TOML also wants DEL escaped, which JSON leaves as it is
        return json.dumps(value, ensure_ascii=False).replace("\x7f", "\\u007f")
    if isinstance(value, (list, tuple)):
        return "[" + ", ".join(toml_value(v) for v in value) + "]"
    raise ValueError(f"{value!r} ({type(value).__name__}) cannot be written to TOML")


def write_toml(path: str | Path, settings: dict[str, Any]) -> None:
    """Training settings as a config file that ``griffin train --config`` reads back equal (the ``model`` mapping
    as a [model] table; None values are left out: they are the defaults); written atomically."""
    from griffin.io import atomic_write

    lines = [f"{key} = {toml_value(v)}" for key, v in settings.items() if key != "model" and v is not None]
    model = settings.get("model") or {}
    if model:
        lines += ["", "[model]"] + [f"{key} = {toml_value(v)}" for key, v in model.items() if v is not None]
    text = "\n".join(lines) + "\n"
    atomic_write(Path(path), lambda tmp: Path(tmp).write_text(text))


def merge_settings(base: dict[str, Any], overrides: dict[str, Any]) -> dict[str, Any]:
    """``overrides`` on top of ``base``; their ``model`` tables merge key by key."""
    model = {**base.get("model", {}), **overrides.get("model", {})}
    return {**base, **overrides, "model": model}


class ConfigTypeError(ValueError, TypeError):
    """A setting of the wrong type: a ValueError (a bad value given by the user) that is also a TypeError."""


@functools.cache
def field_types() -> dict[str, Any]:
    """The resolved annotation of every TrainConfig field (also used to build the command-line flags)."""
    return typing.get_type_hints(TrainConfig)


def check_type(name: str, value: Any, expected: Any) -> None:
    """Raise a :class:`ConfigTypeError` naming ``name`` unless ``value`` matches the annotation ``expected``."""
    origin = typing.get_origin(expected)
    if origin in (typing.Union, types.UnionType):
        for option in typing.get_args(expected):
            try:
                check_type(name, value, option)
                return
            except ConfigTypeError:
                pass
        raise ConfigTypeError(f"{name}={value!r} must be {expected}, got {type(value).__name__}")
    if origin is dict:
        if not isinstance(value, dict):
            raise ConfigTypeError(f"{name} must be a table/dict, got {type(value).__name__}")
        return
    if expected is type(None):
        ok = value is None
    elif expected is float:
        ok = isinstance(value, (int, float)) and not isinstance(value, bool)
    elif expected is int:
        ok = isinstance(value, int) and not isinstance(value, bool)
    else:
        ok = isinstance(value, expected)
    if not ok:
        raise ConfigTypeError(f"{name}={value!r} must be of type {expected.__name__}, got {type(value).__name__}")


def parse_model_override(text: str) -> tuple[str, Any]:
    """``key=value`` with the value read as TOML (``width=256``, ``block_types=["recurrent","attention"]``),
    falling back to a bare string (``family=hawk``)."""
    if "=" not in text:
        raise ValueError(f"--model expects KEY=VALUE, got {text!r}")
    key, raw = text.split("=", 1)
    try:
        value = tomllib.loads(f"v = {raw}")["v"]
    except tomllib.TOMLDecodeError:
        value = raw
    return key.strip(), value
