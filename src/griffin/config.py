"""Model configuration: every architectural choice of the paper, explicit (Section 2, Appendix C)."""

from __future__ import annotations

import dataclasses
import difflib
import json
import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from griffin.io import write_json

FAMILIES = ("mqa", "hawk", "griffin")
BLOCK_TYPES = ("recurrent", "attention", "local_attention")
GELU_APPROXIMATIONS = ("tanh", "none")
A_INIT_RULES = ("ring", "paper")

# Paper, Appendix C (Table 5): size -> (width D, RNN width D_RNN, depth N, attention heads H).
PAPER_SIZES: dict[str, tuple[int, int, int, int]] = {
    "100m": (768, 1024, 12, 6),
    "200m": (1024, 1536, 12, 8),
    "400m": (1536, 2048, 12, 12),
    "1.3b": (2048, 2560, 24, 16),
    "3b": (3072, 4096, 24, 24),
    "7b": (4096, 5632, 32, 32),
    "14b": (5120, 8192, 40, 40),
}


def family_block_types(family: str, depth: int) -> tuple[str, ...]:
    """The temporal-mixing block of each residual block for a model family (Section 3).

    - ``mqa``: global multi-query attention everywhere;
    - ``hawk``: the recurrent block everywhere;
    - ``griffin``: two recurrent blocks, then one local-attention block, repeated.
    """
    if family == "mqa":
        return ("attention",) * depth
    if family == "hawk":
        return ("recurrent",) * depth
    if family == "griffin":
        pattern = ("recurrent", "recurrent", "local_attention")
        return tuple(pattern[i % 3] for i in range(depth))
    raise ValueError(f"invalid ModelConfig: family={family!r} is not one of {FAMILIES}")


@dataclass(frozen=True)
class ModelConfig:
    """Hyper-parameters of an MQA Transformer, Hawk or Griffin model.

    Attributes:
        family: ``mqa``, ``hawk`` or ``griffin``; sets ``block_types`` when that is not given.
        vocab_size: number of tokens in the vocabulary.
        width: model width D.
        depth: number of residual blocks N.
        rnn_width: width D_RNN of the recurrent block (the paper uses about 4D/3).
        mlp_expansion: MLP expansion factor M (3 throughout the paper); the MLP width is M * D
            unless ``mlp_width`` is given.
        mlp_width: explicit MLP width, overriding ``mlp_expansion * width``.
        num_heads: attention heads H.
        head_dim: dimension of each head (default D / H; the paper fixes 128).
        num_kv_heads: key/value heads (1 = multi-query attention).
        block_types: explicit list of temporal-mixing blocks, each ``recurrent``, ``attention``
            (global MQA) or ``local_attention`` (sliding-window MQA).
        attention_window: the number of keys a query of a local-attention block sees,
            **including itself**: query t attends to keys t - attention_window + 1 ... t.
        conv1d_width: temporal width of the recurrent block's causal depthwise Conv1D (4).
        rg_lru_c: the RG-LRU constant c in a_t = a^(c r_t) (8).
        gate_blocks: number of diagonal blocks of the RG-LRU gate weights W_a and W_x (16).
        a_init_range: (min, max) of the decay at initialisation (0.9, 0.999, Section 2.4), read by a_init_rule.
        a_init_rule: ``ring`` (the released implementation): the decay a has a^2 uniform in [min^2, max^2];
            ``paper`` (Section 2.4's text): a^c, the decay at r_t = 1, is uniform in [min, max], so that a starts
            c times closer to 1 in log space and the state is kept longer.
        rope_base: RoPE maximum wavelength.
        rope_fraction: fraction of each head's dimensions that RoPE rotates.
        tie_embeddings: share the embedding with the output layer (the paper does).
        embed_scale: multiply embeddings by sqrt(D) (rounded to bfloat16, as RecurrentGemma does).
        logits_soft_cap: if set, logits = cap * tanh(logits / cap).
        norm_eps: RMSNorm epsilon.
        gelu_approximation: ``tanh`` (as the released models) or ``none`` (exact erf GeLU).
        complex_lru: use the complex-gated CG-LRU of Appendix B instead of the RG-LRU.
        conv1d_document_reset: the Conv1D sees nothing of the previous packed document.
        attention_document_mask: attention sees nothing of the previous packed document.
        init_std: standard deviation of the embedding initialisation (default 1/sqrt(D)).
    """

    family: str = "griffin"
    vocab_size: int = 256
    width: int = 64
    depth: int = 5
    rnn_width: int | None = None
    mlp_expansion: int = 3
    mlp_width: int | None = None
    num_heads: int = 1
    head_dim: int | None = None
    num_kv_heads: int = 1
    block_types: tuple[str, ...] | None = None
    attention_window: int = 1024
    conv1d_width: int = 4
    rg_lru_c: float = 8.0
    gate_blocks: int = 16
    a_init_range: tuple[float, float] = (0.9, 0.999)
    a_init_rule: str = "ring"
    rope_base: float = 10_000.0
    rope_fraction: float = 0.5
    tie_embeddings: bool = True
    embed_scale: bool = False
    logits_soft_cap: float | None = None
    norm_eps: float = 1e-6
    gelu_approximation: str = "tanh"
    complex_lru: bool = False
    conv1d_document_reset: bool = True
    attention_document_mask: bool = True
    init_std: float | None = None
    name: str = field(default="", compare=False)

    def __post_init__(self) -> None:
        self.check_types()
        # Normalise derived fields so that every choice is explicit once built.
        if self.block_types is None:
            object.__setattr__(self, "block_types", family_block_types(self.family, self.depth))
        else:
            object.__setattr__(self, "block_types", tuple(self.block_types))
        if self.rnn_width is None:
            object.__setattr__(self, "rnn_width", self.width)
        if self.mlp_width is None:
            object.__setattr__(self, "mlp_width", self.mlp_expansion * self.width)
        if self.head_dim is None:
            if self.width % self.num_heads:
                raise ValueError(f"invalid ModelConfig: width={self.width} is not divisible by "
                                 f"num_heads={self.num_heads}; set head_dim explicitly")
            object.__setattr__(self, "head_dim", self.width // self.num_heads)
        object.__setattr__(self, "a_init_range", tuple(self.a_init_range))
        self.validate()

    def check_types(self) -> None:
        """Raise a ValueError naming the first field whose type is wrong (a string for a number, a number for a
        flag, ...), before anything is derived from it."""

        def need(cond: bool, key: str, what: str) -> None:
            if not cond:
                raise ValueError(f"invalid ModelConfig: {key}={getattr(self, key)!r} must be {what}")

        for key in ("vocab_size", "width", "depth", "mlp_expansion", "num_heads", "num_kv_heads", "attention_window",
                    "conv1d_width", "gate_blocks"):
            need(_is_int(getattr(self, key)) and getattr(self, key) > 0, key, "a positive integer")
        for key in ("rnn_width", "mlp_width", "head_dim"):
            value = getattr(self, key)
            need(value is None or (_is_int(value) and value > 0), key, "a positive integer (or None: derived)")
        for key in ("rg_lru_c", "rope_base", "rope_fraction", "norm_eps"):
            need(_is_real(getattr(self, key)), key, "a finite number")
        for key in ("logits_soft_cap", "init_std"):
            need(getattr(self, key) is None or _is_real(getattr(self, key)), key, "a finite number or None")
        for key in ("tie_embeddings", "embed_scale", "complex_lru", "conv1d_document_reset",
                    "attention_document_mask"):
            need(isinstance(getattr(self, key), bool), key, "true or false (a bool)")
        for key in ("family", "gelu_approximation", "a_init_rule", "name"):
            need(isinstance(getattr(self, key), str), key, "a string")
        need(self.block_types is None or (isinstance(self.block_types, (list, tuple))
                                          and all(isinstance(k, str) for k in self.block_types)),
             "block_types", "a list of block type names (or None: the family's pattern)")
        rng = self.a_init_range
        need(isinstance(rng, (list, tuple)) and len(rng) == 2 and all(_is_real(v) for v in rng), "a_init_range",
             "a pair (min, max) of numbers")

    def validate(self) -> None:
        """Raise a ValueError naming the first value that cannot build a model."""

        def need(cond: bool, msg: str) -> None:
            if not cond:
                raise ValueError(f"invalid ModelConfig: {msg}")

        need(self.family in FAMILIES, f"family={self.family!r} is not one of {FAMILIES}")
        for key in ("vocab_size", "width", "depth", "rnn_width", "mlp_width", "num_heads", "head_dim",
                    "num_kv_heads", "attention_window", "conv1d_width", "gate_blocks"):
            value = getattr(self, key)
            need(_is_int(value) and value > 0, f"{key}={value!r} must be a positive integer")
        need(len(self.block_types) == self.depth,
             f"block_types has {len(self.block_types)} entries but depth={self.depth}")
        for i, kind in enumerate(self.block_types):
            need(kind in BLOCK_TYPES, f"block_types[{i}]={kind!r} is not one of {BLOCK_TYPES}")
        need(self.num_heads % self.num_kv_heads == 0,
             f"num_heads={self.num_heads} is not divisible by num_kv_heads={self.num_kv_heads}")
        need(self.head_dim % 2 == 0, f"head_dim={self.head_dim} must be even for RoPE")
        need(0.0 <= self.rope_fraction <= 1.0, f"rope_fraction={self.rope_fraction} must lie in [0, 1]")
        rotated = self.rope_dim
        need(rotated % 2 == 0, f"rope_fraction={self.rope_fraction} rotates {rotated} dims of "
             f"head_dim={self.head_dim}; that must be an even number")
        need(self.rope_base > 0, f"rope_base={self.rope_base} must be positive")
        lru = self.lru_width
        need(lru % self.gate_blocks == 0,
             f"{'rnn_width/2' if self.complex_lru else 'rnn_width'}={lru} is not divisible by "
             f"gate_blocks={self.gate_blocks}")
        if self.complex_lru:
            need(self.rnn_width % 2 == 0, f"rnn_width={self.rnn_width} must be even for the complex CG-LRU")
            need(self.rnn_width % self.gate_blocks == 0,
                 f"rnn_width={self.rnn_width} is not divisible by gate_blocks={self.gate_blocks}")
        lo, hi = self.a_init_range
        need(0.0 < lo <= hi < 1.0, f"a_init_range={self.a_init_range} must satisfy 0 < min <= max < 1")
        need(self.rg_lru_c > 0, f"rg_lru_c={self.rg_lru_c} must be positive")
        need(self.logits_soft_cap is None or self.logits_soft_cap > 0,
             f"logits_soft_cap={self.logits_soft_cap} must be positive or None")
        need(self.norm_eps >= 0, f"norm_eps={self.norm_eps} must be non-negative")
        need(self.init_std is None or self.init_std > 0, f"init_std={self.init_std} must be positive or None")
        need(self.gelu_approximation in GELU_APPROXIMATIONS,
             f"gelu_approximation={self.gelu_approximation!r} is not one of {GELU_APPROXIMATIONS}")
        need(self.a_init_rule in A_INIT_RULES, f"a_init_rule={self.a_init_rule!r} is not one of {A_INIT_RULES}")

    # Derived quantities -------------------------------------------------------------------------
    @property
    def lru_width(self) -> int:
        """Number of (real or complex) recurrence channels of the RG-LRU / CG-LRU."""
        return self.rnn_width // 2 if self.complex_lru else self.rnn_width

    @property
    def rope_dim(self) -> int:
        """Number of dimensions of each head that RoPE rotates."""
        return int(round(self.head_dim * self.rope_fraction))

    # Construction -------------------------------------------------------------------------------
    @classmethod
    def from_preset(cls, name: str, **overrides: Any) -> ModelConfig:
        """A named preset (see ``griffin.config.PRESETS``), with field overrides (see :meth:`replace`)."""
        if name not in PRESETS:
            close = difflib.get_close_matches(name, PRESETS, n=3)
            hint = f"; did you mean {' or '.join(close)}?" if close else f"; available: {', '.join(sorted(PRESETS))}"
            raise ValueError(f"unknown preset {name!r}{hint}")
        return PRESETS[name].replace(name=name, **overrides)

    def replace(self, **changes: Any) -> ModelConfig:
        """A copy with ``changes``; the derived fields follow what they derive from unless they were set to something
        else: ``mlp_width`` (``mlp_expansion`` × ``width``), ``rnn_width`` (``width``), ``head_dim`` (``width`` /
        ``num_heads``) and ``block_types`` (the family's pattern over ``depth``). A change that cannot apply (say
        ``mlp_expansion`` where ``mlp_width`` was set otherwise) is an error naming both."""
        unknown = sorted(set(changes) - {f.name for f in dataclasses.fields(self)})
        if unknown:
            close = difflib.get_close_matches(unknown[0], [f.name for f in dataclasses.fields(self)], n=1)
            raise ValueError(f"unknown ModelConfig field {unknown[0]!r}" + (f"; did you mean {close[0]!r}?" if close
                                                                            else ""))
        derived = {  # field -> (what it derives from, whether it currently holds its derived value)
            "mlp_width": (("mlp_expansion", "width"), self.mlp_width == self.mlp_expansion * self.width),
            "rnn_width": (("width",), self.rnn_width == self.width),
            "head_dim": (("width", "num_heads"), self.num_heads > 0 and self.head_dim * self.num_heads == self.width),
            "block_types": (("family", "depth"), self.block_types == family_block_types(self.family, self.depth)),
        }
        changes = dict(changes)
        for field_name, (sources, follows) in derived.items():
            moved = [s for s in sources if s in changes and changes[s] != getattr(self, s)]
            if not moved or field_name in changes:
                continue
            if follows:
                changes[field_name] = None  # derived again from the new values
            elif field_name == "mlp_width" and moved == ["mlp_expansion"]:
                raise ValueError(f"mlp_expansion={changes['mlp_expansion']!r} cannot apply: mlp_width={self.mlp_width} "
                                 f"is set explicitly here; override mlp_width instead")
            elif field_name == "block_types" and "family" in moved:
                raise ValueError(f"family={changes['family']!r} cannot apply: block_types is set explicitly here; "
                                 f"override block_types too")
        return dataclasses.replace(self, **changes)

    def to_dict(self) -> dict[str, Any]:
        out = dataclasses.asdict(self)
        out["block_types"] = list(self.block_types)
        out["a_init_range"] = list(self.a_init_range)
        return out

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> ModelConfig:
        """The config of a ``to_dict`` dictionary (a config.json); unknown keys and wrong types are refused."""
        if not isinstance(data, dict):
            raise ValueError(f"a ModelConfig must be a JSON object of fields, got {type(data).__name__}")
        known = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(data) - known)
        if unknown:
            raise ValueError(f"unknown ModelConfig keys: {unknown}")
        data = dict(data)
        for key in ("block_types", "a_init_range"):
            if isinstance(data.get(key), list):
                data[key] = tuple(data[key])
        return cls(**data)

    def save(self, path: str | Path) -> None:
        """Write the config as JSON, atomically."""
        write_json(Path(path), self.to_dict())

    @classmethod
    def load(cls, path: str | Path) -> ModelConfig:
        """Read a config written by :meth:`save`; every error names the file."""
        path = Path(path)
        try:
            return cls.from_dict(json.loads(path.read_text()))
        except json.JSONDecodeError as err:
            raise ValueError(f"{path} is not valid JSON: {err}") from None
        except ValueError as err:
            raise ValueError(f"{path}: {err}") from None


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _is_real(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)


def _paper_preset(family: str, size: str) -> ModelConfig:
    width, rnn_width, depth, heads = PAPER_SIZES[size]
    return ModelConfig(
        family=family, vocab_size=32_000, width=width, depth=depth, rnn_width=rnn_width,
        num_heads=heads, head_dim=128, attention_window=1024, gate_blocks=16,
    )


def _build_presets() -> dict[str, ModelConfig]:
    presets: dict[str, ModelConfig] = {}
    for family in FAMILIES:
        for size in PAPER_SIZES:
            presets[f"{family}-{size}"] = _paper_preset(family, size)
        # Synthetic tasks (Section 6.2): 5 blocks, D = 64, Griffin's local-attention block third.
        presets[f"{family}-synthetic"] = ModelConfig(
            family=family, vocab_size=256, width=64, depth=5, rnn_width=64, num_heads=2, head_dim=32,
            gate_blocks=8, attention_window=512,
        )
        # CPU training (the README's demo): about a million parameters, D_RNN ~ 4D/3 as in the paper.
        presets[f"{family}-cpu"] = ModelConfig(
            family=family, vocab_size=256, width=128, depth=6, rnn_width=192, num_heads=2, head_dim=64,
            gate_blocks=4, attention_window=128,
        )
        # Tests: a few thousand parameters and a window small enough for tests to cross.
        presets[f"{family}-tiny"] = ModelConfig(
            family=family, vocab_size=32, width=16, depth=4, rnn_width=24, num_heads=2, head_dim=8,
            gate_blocks=4, attention_window=6,
        )
    gemma = dict(
        family="griffin", vocab_size=256_000, num_kv_heads=1, head_dim=256, attention_window=2048,
        embed_scale=True, logits_soft_cap=30.0, rope_fraction=0.5, tie_embeddings=True,
    )
    presets["recurrentgemma-2b"] = ModelConfig(
        width=2560, depth=26, rnn_width=2560, num_heads=10, gate_blocks=10, **gemma
    )
    presets["recurrentgemma-9b"] = ModelConfig(
        width=4096, depth=38, rnn_width=4096, num_heads=16, gate_blocks=16, **gemma
    )
    return presets


PRESETS: dict[str, ModelConfig] = _build_presets()


def nominal_size(n: int) -> str:
    """A human-readable parameter count: 1.3B, 250K."""
    for unit, scale in (("B", 1e9), ("M", 1e6), ("K", 1e3)):
        if n >= scale:
            value = n / scale
            digits = 0 if value >= 100 else 1 if value >= 10 else 2
            return f"{value:.{digits}f}{unit}"
    return str(n)


__all__ = ["ModelConfig", "PRESETS", "PAPER_SIZES", "family_block_types", "nominal_size"]
