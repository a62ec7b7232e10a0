"""Several LoRA adapters served unmerged on one base model, chosen per request (``griffin serve BASE --adapter
name=DIR ...``).

Each adapted projection of a copy of the model (:func:`multi_lora_swapped`, a module swap applied from outside the
model, as the decode swaps are) becomes a :class:`MultiLoRALinear`: the base layer's output, plus for each row of the
batch the low-rank term of that row's adapter, ``scale_a (x A_a^T) B_a^T`` (Hu et al., 2021), where ``a`` is the
row's adapter. The adapters' ``A`` (r, in) and ``B`` (out, r) of one layer are stacked into (N + 1, r_max, in) and
(N + 1, out, r_max), ranks padded to the largest with zeros, the scale folded into ``B``, and a last all-zero adapter
standing for the base model. A forward pass is one call per layer for the whole batch, never a loop over rows: rows all
on one adapter take two matmuls; rows on several, while the adapters' ranks add up to few columns
(:data:`MASKED_COLUMNS`), two matmuls over all the adapters side by side with each row's other adapters' columns
zeroed; beyond that, a gather of each row's pair (``A[index]``) and two batched matmuls, as vLLM's and S-LoRA's
multi-LoRA kernels do. The rows' adapters are set before each forward pass on the :class:`AdapterRows` that every
wrapped layer of the model (and of its decode copies) shares.

The base matmul stays whatever the layer is (``nn.Linear``, int8, or the decode copy's prepacked or matvec swap of
it), so the swap composes with :func:`griffin.inference.generate.decode_model`; what is lost is the fusing of a
block's projections that share an input into one kernel call (docs/serving.md, "Several adapters").
"""

from __future__ import annotations

import copy
import itertools
import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from griffin.data.chat import find_chat_template
from griffin.interop.adapters import Adapter, AdapterError, check_base, read_adapter
from griffin.model import CausalLM
from griffin.quantize import quantization_of

NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9._:-]*")  # what an adapter may be called (the request's model field)


@dataclass
class ServedAdapter:
    """One adapter as served: its ``name`` (the ``model`` field that picks it), its directory, what was read from it,
    and the chat template stored beside it (None: the base's)."""

    name: str
    path: Path
    adapter: Adapter
    chat_template: str | None = None


@dataclass
class AdapterSet:
    """The adapters served on one base model, in order: adapter ``i`` is row index ``i`` of :class:`AdapterRows`."""

    adapters: list[ServedAdapter] = field(default_factory=list)

    @property
    def names(self) -> list[str]:
        return [a.name for a in self.adapters]

    def index(self, name: str | None) -> int:
        """The index of the adapter called ``name`` (-1 for None: the base model); a KeyError naming it if none."""
        if name is None:
            return -1
        for i, a in enumerate(self.adapters):
            if a.name == name:
                return i
        raise KeyError(f"no adapter {name!r} is served (adapters: {', '.join(self.names) or 'none'})")

    def __len__(self) -> int:
        return len(self.adapters)

    def modules(self) -> list[str]:
        """The griffin module names any adapter adapts, sorted."""
        return sorted({m for a in self.adapters for m in a.adapter.pairs})

    @property
    def r_max(self) -> int:
        """The largest rank of the adapters (every layer's stacks are padded to it)."""
        return max(a.adapter.settings.r for a in self.adapters)

    def stacked(self, module: str, dtype: torch.dtype, device: torch.device) -> tuple[Tensor, Tensor]:
        """The adapters' pairs of ``module`` stacked: A (N + 1, r_max, in) and B (N + 1, out, r_max) with each
        adapter's scale folded into B, ranks padded with zeros to the largest adapter's, zeros for adapters that do
        not adapt ``module`` and for the base model (the last)."""
        shapes = [a.adapter.pairs[module] for a in self.adapters if module in a.adapter.pairs]
        r_max = self.r_max
        d_in, d_out = shapes[0][0].shape[1], shapes[0][1].shape[0]
        A = torch.zeros(len(self) + 1, r_max, d_in, dtype=torch.float64)
        B = torch.zeros(len(self) + 1, d_out, r_max, dtype=torch.float64)
        for i, served in enumerate(self.adapters):
            if module in served.adapter.pairs:
                a, b = served.adapter.pairs[module]
                A[i, : a.shape[0]] = a.double()
                B[i, :, : b.shape[1]] = b.double() * served.adapter.settings.scale
        return A.to(device, dtype), B.to(device, dtype)


def load_adapters(model: CausalLM, specs: Mapping[str, str | Path] | Sequence[tuple[str, str | Path]],
                  base_name: str | None = None) -> AdapterSet:
    """Read the adapters ``specs`` (name -> PEFT adapter directory) for ``model``: each must fit its layers
    (:func:`griffin.interop.adapters.read_adapter`) and, where it records one, the fingerprint of its base weights
    (:func:`griffin.interop.adapters.check_base`: an adapter trained on another base model is refused). Names must be
    distinct, unlike ``base_name`` (the served base model's), and made of letters, digits and ``._:-``. Each bad one is
    a ValueError or :class:`griffin.interop.adapters.AdapterError` naming it."""
    items = list(specs.items()) if isinstance(specs, Mapping) else list(specs)
    if quantization_of(model) is not None:
        raise AdapterError("the model holds int8 weights, against which an adapter's base cannot be checked: load "
                           "the float checkpoint and quantise it after the adapters are read (griffin serve "
                           "--quantize int8 does)")
    served, seen = [], set()
    for name, directory in items:
        if not isinstance(name, str) or not NAME.fullmatch(name):
            raise ValueError(f"adapter name {name!r} must be letters, digits and ._:- (it is a request's model field)")
        if name in seen:
            raise ValueError(f"adapter name {name!r} is given twice")
        if name == base_name:
            raise ValueError(f"adapter name {name!r} is the base model's served name: give the adapter another")
        seen.add(name)
        adapter = read_adapter(directory, model.config)
        weights = {m: model.get_submodule(m).weight for m in adapter.pairs}
        try:
            check_base(adapter, weights)
        except AdapterError as err:
            raise AdapterError(f"adapter {name!r}: {err}") from None
        served.append(ServedAdapter(name, Path(directory), adapter, find_chat_template(directory)))
    return AdapterSet(served)


#: A batch on several adapters computes every adapter's low-rank term for every row, the other adapters' columns
#: masked, while the adapters' ranks add up to at most this (two plain matmuls: faster than a gather and two batched
#: matmuls until there are many adapters; benchmarks/serve_lora.py); beyond it, each row's pair is gathered.
MASKED_COLUMNS = 256


class AdapterRows:
    """Which adapter each row of the next forward passes uses, shared by every :class:`MultiLoRALinear` of a model
    and of its copies (a deep copy returns this same object). Set with :meth:`set` before a forward pass."""

    def __init__(self, n_adapters: int, r_max: int, dtype: torch.dtype = torch.float32) -> None:
        self.n_adapters, self.r_max, self.dtype = n_adapters, r_max, dtype
        self.mode = "none"  # none (every row on the base), single, masked or gather
        self.single: int | None = None  # the one adapter of every row (single)
        self.mask: Tensor | None = None  # (rows, N r_max): 1 in each row's adapter's columns (masked)
        self.index: Tensor | None = None  # (rows,) into the stacks, the base model N: the zero adapter (gather)

    def __deepcopy__(self, memo: dict) -> AdapterRows:
        return self  # shared by design: the decode copy of the model reads the rows the engine sets

    def set(self, adapters: Sequence[int], device: torch.device | str = "cpu") -> None:
        """The rows' adapter indices (-1: the base model), in the batch's row order."""
        ids = [int(a) for a in adapters]
        bad = [a for a in ids if not -1 <= a < self.n_adapters]
        if bad:
            raise ValueError(f"adapter index {bad[0]} is out of range for {self.n_adapters} adapters (-1: the base)")
        distinct = set(ids)
        self.single = self.mask = self.index = None
        if distinct <= {-1}:
            self.mode = "none"
        elif len(distinct) == 1:
            self.mode, self.single = "single", ids[0]
        elif self.n_adapters * self.r_max <= MASKED_COLUMNS:
            self.mode = "masked"
            mask = torch.zeros(len(ids), self.n_adapters, self.r_max, dtype=self.dtype)
            for row, a in enumerate(ids):
                if a >= 0:
                    mask[row, a] = 1
            self.mask = mask.reshape(len(ids), -1).to(device)
        else:
            self.mode = "gather"
            self.index = torch.tensor([self.n_adapters if a < 0 else a for a in ids], dtype=torch.long,
                                      device=device)


class MultiLoRALinear(nn.Module):
    """``base(x)`` plus each row's low-rank term: for rows x (R, ..., in) whose adapters ``rows`` gives,
    ``base(x)[i] + (x[i] A_a^T) B_a^T`` with ``a`` row i's adapter (scale folded into B; the base model's rows add
    nothing). One adapter for every row is two matmuls. Several are one call per layer for the whole batch, never a
    loop over rows: while the adapters' ranks add up to few columns (:data:`MASKED_COLUMNS`), two matmuls over all
    the adapters side by side with each row's other adapters masked out; beyond, a gather of each row's pair
    (``A[index]``) and two batched matmuls (``torch.bmm``)."""

    def __init__(self, base: nn.Module, A: Tensor, B: Tensor, rows: AdapterRows) -> None:
        super().__init__()
        self.base = base
        n, r, _ = A.shape
        self.register_buffer("A", A, persistent=False)  # (N + 1, r_max, in)
        self.register_buffer("B", B, persistent=False)  # (N + 1, out, r_max)
        # the adapters side by side: A_all (N r_max, in) a view of A, B_all (out, N r_max)
        self.register_buffer("B_all", B[: n - 1].permute(1, 0, 2).reshape(B.shape[1], (n - 1) * r).contiguous(),
                             persistent=False)
        self.rows = rows

    def forward(self, x: Tensor) -> Tensor:
        y = self.base(x)
        rows = self.rows
        if rows.mode == "none":
            return y
        h = x.to(self.A.dtype)
        if rows.mode == "single":
            delta = F.linear(F.linear(h, self.A[rows.single]), self.B[rows.single])
        elif rows.mode == "masked":
            mask = rows.mask
            if mask.shape[0] != x.shape[0]:
                raise ValueError(f"adapters were set for {mask.shape[0]} rows, but the input has {x.shape[0]}")
            n, r, d_in = self.A.shape
            low = F.linear(h, self.A[: n - 1].reshape((n - 1) * r, d_in))  # (R, ..., N r_max)
            low = low * mask.view(mask.shape[0], *([1] * (x.dim() - 2)), mask.shape[1])
            delta = F.linear(low, self.B_all)
        else:
            index = rows.index
            if index.shape[0] != x.shape[0]:
                raise ValueError(f"adapters were set for {index.shape[0]} rows, but the input has {x.shape[0]}")
            flat = h.reshape(x.shape[0], -1, x.shape[-1])  # (R, T, in)
            low = torch.bmm(flat, self.A[index].transpose(1, 2))  # (R, T, r_max)
            delta = torch.bmm(low, self.B[index].transpose(1, 2)).reshape(*x.shape[:-1], -1)
        return y + delta.to(y.dtype)

    def extra_repr(self) -> str:
        n, r, d_in = self.A.shape
        return f"adapters={n - 1}, r_max={r}, in_features={d_in}, out_features={self.B.shape[1]}"


def multi_lora_swapped(model: CausalLM, adapters: AdapterSet, rows: AdapterRows | None = None) -> CausalLM:
    """A copy of ``model`` sharing its tensors in which every layer some adapter adapts is a
    :class:`MultiLoRALinear` over the original layer, its stacks in the model's activation dtype; ``rows`` (made if
    None) is shared by them all, reachable as ``copy.adapter_rows``. ``model`` itself is not changed."""
    if not len(adapters):
        raise ValueError("no adapters to serve")
    if rows is None:
        rows = AdapterRows(len(adapters), adapters.r_max, model.dtype)
    memo = {id(t): t for t in itertools.chain(model.parameters(), model.buffers())}
    clone = copy.deepcopy(model, memo)
    for name in adapters.modules():
        parent, _, leaf = name.rpartition(".")
        owner = clone.get_submodule(parent) if parent else clone
        layer = getattr(owner, leaf)
        A, B = adapters.stacked(name, model.dtype, model.device)
        setattr(owner, leaf, MultiLoRALinear(layer, A, B, rows))
    clone.adapter_rows = rows
    return clone


@torch.no_grad()
def merged_reference(model: CausalLM, adapter: ServedAdapter | Adapter) -> CausalLM:
    """A copy of ``model`` with ``adapter`` merged into its weights (W + scale B A, in float64 then rounded once):
    what each row of a :class:`MultiLoRALinear` batch computes, for tests to compare with."""
    adapter = adapter.adapter if isinstance(adapter, ServedAdapter) else adapter
    out = copy.deepcopy(model)
    for name, (a, b) in adapter.pairs.items():
        w = out.get_submodule(name).weight
        delta = (b.double() @ a.double()) * adapter.settings.scale
        w.copy_((w.double() + delta.to(w.device)).to(w.dtype))
    return out


__all__ = ["MASKED_COLUMNS", "AdapterRows", "AdapterSet", "MultiLoRALinear", "ServedAdapter", "load_adapters",
           "merged_reference", "multi_lora_swapped"]
