"""The ``griffin`` model of lm-evaluation-harness (downstream tasks, Section 3.2, Table 2).

``lm_eval --model griffin --model_args pretrained=CKPT,dtype=float32,batch_size=16 --tasks ...`` once this module
is imported (``griffin eval harness`` and ``python -m griffin.evaluation`` do; lm-eval versions that discover
plugins load it from the ``lm_eval.models`` entry point of this package). Requests are answered with griffin's own
inference path:

- ``loglikelihood``: requests are grouped by context; each distinct context is prefilled once (contexts of similar
  length batched together, left-padded), its state is forked to every continuation of it (``Cache.select``: a
  fixed-size state for Hawk and Griffin), and the continuations run together from the forked states. The first
  continuation token is scored from the context's last logits, so one-token continuations (MMLU's letters) cost no
  forward pass at all.
- ``loglikelihood_rolling``: the whole text after the prefix token, streamed in chunks with the state carried
  (:func:`griffin.evaluation.loss.token_losses`): every token sees the whole document before it.
- ``generate_until``: prefill + decode until the stop strings (:func:`griffin.evaluation.generation.generate_until`).
"""

from __future__ import annotations

import json
import warnings
from collections import defaultdict
from collections.abc import Sequence
from typing import Any

import lm_eval.models  # noqa: F401  (the harness' own models first: registering into an empty registry hides them)
import torch
import torch.nn.functional as F
from lm_eval.api.model import TemplateLM
from lm_eval.api.registry import register_model
from tqdm import tqdm

from griffin.data.tokenizer import Tokenizer, load_tokenizer
from griffin.evaluation.generation import generate_until
from griffin.evaluation.loss import token_losses
from griffin.inference import prefill
from griffin.loading import load_for_use
from griffin.model import CausalLM

NEWLINE_BYTE = 10  # the prefix token of byte-level models without BOS/EOS: documents start after a line break


def _positive_int(name: str, value: Any) -> int:
    try:
        number = int(value)
    except (TypeError, ValueError):
        raise ValueError(f"{name}={value!r} must be a positive integer") from None
    if number < 1 or (isinstance(value, float) and value != number):
        raise ValueError(f"{name}={value!r} must be a positive integer")
    return number


@register_model("griffin")
class GriffinLM(TemplateLM):
    """A griffin checkpoint (``pretrained``: griffin, HF RecurrentGemma or official) or an in-memory ``model`` with
    its ``tokenizer`` (a Tokenizer, or a spec: ``auto`` = the checkpoint's own, ``bytes``, a file).

    ``batch_size``: contexts prefilled together (then all their continuations run together); ``max_length``: truncate
    (from the left) inputs longer than this many tokens, as the ``hf`` model does (default: no limit; Hawk and
    Griffin have none, MQA sizes its KV cache to the input); ``chunk_size``: prefill chunk (bounds memory);
    ``add_bos_token``: prepend the tokenizer's BOS (default: when it has one, as ``griffin prepare`` frames
    training documents)."""

    def __init__(self, pretrained: str | None = None, *, model: CausalLM | None = None,
                 tokenizer: str | Tokenizer = "auto", dtype: str | None = None, batch_size: int | str = 16,
                 max_batch_size: int | None = None, device: str | None = None, max_length: int | None = None,
                 chunk_size: int = 1024, max_gen_toks: int = 256, add_bos_token: bool | None = None,
                 prefix_token_id: int | None = None, adapter: str | None = None, **unused: Any) -> None:
        super().__init__()
        known_extras = {"trust_remote_code", "parallelize", "revision"}  # harness-wide options with no meaning here
        unknown = sorted(set(unused) - known_extras)
        if unknown:
            raise ValueError(f"unknown griffin model_args {unknown}: use pretrained, adapter, tokenizer, dtype, "
                             "batch_size, device, max_length, chunk_size, max_gen_toks, add_bos_token, prefix_token_id")
        device = device or "cpu"
        if str(device).startswith("cuda") and not torch.cuda.is_available():
            # lm_eval's command line passes --device cuda by default; the hf model falls back the same way
            warnings.warn(f"device {device!r} is not available: evaluating on the CPU", stacklevel=2)
            device = "cpu"
        if model is None:
            if pretrained is None:
                raise ValueError("the griffin model needs pretrained=CHECKPOINT (or model= in Python)")
            loaded = load_for_use(pretrained, tokenizer=tokenizer, dtype=dtype, device=device, adapter=adapter or None)
            model, tok = loaded.model, loaded.tokenizer
        else:
            tok = load_tokenizer("bytes" if tokenizer == "auto" else tokenizer) if isinstance(tokenizer, str) \
                else tokenizer
            model = model.eval()
            if tok.vocab_size > model.config.vocab_size:
                raise ValueError(f"the tokenizer has {tok.vocab_size} tokens but the model only "
                                 f"{model.config.vocab_size}")
        self.model, self.tokenizer = model, tok
        self._device = model.device
        self._batch_size = 16 if str(batch_size).startswith("auto") else _positive_int("batch_size", batch_size)
        self._max_length = None if max_length in (None, "", "None") else _positive_int("max_length", max_length)
        self.chunk_size = _positive_int("chunk_size", chunk_size)
        self._max_gen_toks = _positive_int("max_gen_toks", max_gen_toks)
        if isinstance(add_bos_token, str):
            add_bos_token = add_bos_token.lower() in ("1", "true", "yes")
        self.add_bos_token = tok.bos_id is not None if add_bos_token is None else bool(add_bos_token)
        if prefix_token_id is not None:
            prefix_token_id = int(prefix_token_id)
            if not 0 <= prefix_token_id < model.config.vocab_size:
                raise ValueError(f"prefix_token_id={prefix_token_id} is outside the vocabulary")
        self._prefix = prefix_token_id
        self.pretrained = pretrained

    # Properties the harness reads ---------------------------------------------------------------------------------
    @property
    def eot_token_id(self) -> int:
        tok = self.tokenizer
        if tok.eos_id is not None:
            return tok.eos_id
        return tok.bos_id if tok.bos_id is not None else NEWLINE_BYTE

    @property
    def prefix_token_id(self) -> int:
        if self._prefix is not None:
            return self._prefix
        tok = self.tokenizer
        return tok.bos_id if tok.bos_id is not None else self.eot_token_id

    @property
    def max_length(self) -> int:
        return self._max_length or 1 << 30

    @property
    def max_gen_toks(self) -> int:
        return self._max_gen_toks

    @property
    def batch_size(self) -> int:
        return self._batch_size

    @property
    def device(self) -> torch.device:
        return self._device

    @property
    def tokenizer_name(self) -> str:
        return str(self.pretrained or "griffin")

    def tok_encode(self, string: str, add_special_tokens: bool | None = None, **kwargs: Any) -> list[int]:
        ids = list(self.tokenizer.encode(string))
        bos = self.tokenizer.bos_id
        add = self.add_bos_token if add_special_tokens is None else add_special_tokens
        if add and bos is not None and (not ids or ids[0] != bos):
            ids = [bos] + ids
        return ids

    def tok_decode(self, tokens: Sequence[int], **kwargs: Any) -> str:
        return self.tokenizer.decode(list(tokens))

    # loglikelihood ---------------------------------------------------------------------------------------------
    def _loglikelihood_tokens(self, requests: list[tuple[tuple[str, str], list[int], list[int]]],
                              disable_tqdm: bool = False, **kwargs: Any) -> list[tuple[float, bool]]:
        results = self.score_continuations([(ctx, cont) for _, ctx, cont in requests], disable_tqdm)
        for (request, _, _), answer in zip(requests, results, strict=True):
            if request is not None:
                self.cache_hook.add_partial("loglikelihood", request, answer)
        return results

    @torch.no_grad()
    def score_continuations(self, pairs: Sequence[tuple[Sequence[int], Sequence[int]]],
                            disable_tqdm: bool = True) -> list[tuple[float, bool]]:
        """(log p(continuation | context), whether greedy decoding gives the continuation) for token pairs: each
        distinct context prefilled once, its state forked to its continuations."""
        groups: dict[tuple[int, ...], list[int]] = defaultdict(list)
        for i, (ctx, cont) in enumerate(pairs):
            if not ctx or not cont:
                raise ValueError(f"request {i}: context and continuation must each hold a token")
            ctx = list(ctx)
            if self._max_length is not None and len(ctx) + len(cont) > self._max_length + 1:
                keep = self._max_length + 1 - len(cont)
                if keep < 1:
                    raise ValueError(f"request {i}: a continuation of {len(cont)} tokens exceeds max_length")
                ctx = ctx[-keep:]
            groups[tuple(ctx)].append(i)
        order = sorted(groups, key=lambda c: -len(c))
        results: list[tuple[float, bool] | None] = [None] * len(pairs)
        with tqdm(total=len(pairs), desc="griffin loglikelihood", disable=disable_tqdm, dynamic_ncols=True) as bar:
            for start in range(0, len(order), self.batch_size):
                contexts = order[start : start + self.batch_size]
                rows = [(g, i) for g, ctx in enumerate(contexts) for i in groups[ctx]]
                self._score_batch(pairs, contexts, rows, results)
                bar.update(len(rows))
        return results  # type: ignore[return-value]

    def _score_batch(self, pairs, contexts, rows, results) -> None:
        longest_cont = max(len(pairs[i][1]) for _, i in rows)
        logits, cache = prefill(self.model, [list(c) for c in contexts],
                                max_length=len(contexts[0]) + longest_cont, chunk_size=self.chunk_size)
        first = F.log_softmax(logits.float(), dim=-1)  # (contexts, V): the first continuation token's
        # every continuation of these contexts in one forward pass (fewer, larger matrix products than
        # batch_size rows at a time), from the forked context states
        conts = [list(pairs[i][1]) for _, i in rows]
        rest = max(len(c) for c in conts) - 1
        logp = None
        if rest:  # the continuations without their last token
            ids = torch.zeros(len(rows), rest, dtype=torch.long)
            for r, cont in enumerate(conts):
                ids[r, : len(cont) - 1] = torch.tensor(cont[:-1])
            fork = cache.select([g for g, _ in rows])
            logp = F.log_softmax(self.model(ids.to(self.device), cache=fork).float(), dim=-1)
        for r, ((g, i), cont) in enumerate(zip(rows, conts, strict=True)):
            target = torch.tensor(cont, device=self.device)
            steps = first[g][None] if logp is None else torch.cat([first[g][None], logp[r, : len(cont) - 1]])
            total = float(steps.gather(-1, target[:, None]).sum())
            greedy = bool((steps.argmax(-1) == target).all())
            results[i] = (total, greedy)

    # loglikelihood_rolling -------------------------------------------------------------------------------------
    @torch.no_grad()
    def loglikelihood_rolling(self, requests, disable_tqdm: bool = False) -> list[float]:
        docs = [[self.prefix_token_id] + self.tok_encode(req.args[0], add_special_tokens=False) for req in requests]
        out: list[float] = [0.0] * len(docs)
        order = sorted(range(len(docs)), key=lambda i: -len(docs[i]))
        total = sum(len(d) - 1 for d in docs)
        with tqdm(total=total, unit="tok", desc="griffin loglikelihood_rolling", disable=disable_tqdm,
                  dynamic_ncols=True) as bar:
            for start in range(0, len(order), self.batch_size):
                batch = order[start : start + self.batch_size]
                for i, losses in zip(batch, token_losses(self.model, [docs[i] for i in batch], self.chunk_size,
                                                        bar), strict=True):
                    out[i] = -float(losses.sum())
        for req, value in zip(requests, out, strict=True):
            self.cache_hook.add_partial("loglikelihood_rolling", req.args, value)
        return out

    # generate_until --------------------------------------------------------------------------------------------
    def generate_until(self, requests, disable_tqdm: bool = False) -> list[str]:
        by_kwargs: dict[str, list[int]] = defaultdict(list)
        for i, req in enumerate(requests):
            by_kwargs[json.dumps(req.args[1], sort_keys=True, default=str)].append(i)
        out: list[str] = [""] * len(requests)
        with tqdm(total=len(requests), desc="griffin generate_until", disable=disable_tqdm,
                  dynamic_ncols=True) as bar:
            for key, indices in by_kwargs.items():
                kwargs = dict(json.loads(key))
                until = kwargs.pop("until", None) or []
                until = [until] if isinstance(until, str) else list(until)
                max_new = _positive_int("max_gen_toks", kwargs.pop("max_gen_toks", self.max_gen_toks))
                sampling = bool(kwargs.pop("do_sample", False))
                temperature = float(kwargs.pop("temperature", 0.0)) if sampling else 0.0
                contexts = {i: self.tok_encode(requests[i].args[0]) for i in indices}
                if self._max_length is not None:
                    keep = max(self._max_length - max_new, 1)
                    contexts = {i: c[-keep:] for i, c in contexts.items()}
                order = sorted(indices, key=lambda i: -len(contexts[i]))
                for start in range(0, len(order), self.batch_size):
                    batch = order[start : start + self.batch_size]
                    texts = generate_until(self.model, [contexts[i] for i in batch], self.tokenizer, until, max_new,
                                           temperature=temperature, chunk_size=self.chunk_size)
                    for i, text in zip(batch, texts, strict=True):
                        out[i] = text
                        self.cache_hook.add_partial("generate_until", requests[i].args, text)
                    bar.update(len(batch))
        return out


def evaluate_tasks(model: str | CausalLM | GriffinLM, tasks: list[str], task_data: str | None = None, *,
                   num_fewshot: int | None = None, limit: int | float | None = None, log_samples: bool = False,
                   **model_args: Any) -> dict[str, Any]:
    """Run griffin's offline tasks (:mod:`griffin.evaluation.tasks`: the paper's six, their MMLU subjects,
    phonebook) through ``lm_eval.simple_evaluate`` with the ``griffin`` model. ``model``: a checkpoint path, a
    CausalLM (``model_args`` may give its ``tokenizer``) or a GriffinLM. Returns the harness' results dict."""
    import tempfile

    from lm_eval import simple_evaluate
    from lm_eval.tasks import TaskManager

    from griffin.evaluation.tasks import render_tasks

    with tempfile.TemporaryDirectory(prefix="griffin-tasks-") as tmp:
        names = render_tasks(tasks, task_data, tmp)  # every data file checked before the model is loaded
        if isinstance(model, GriffinLM):
            lm = model
        elif isinstance(model, CausalLM):
            lm = GriffinLM(model=model, **model_args)
        else:
            lm = GriffinLM(str(model), **model_args)
        results = simple_evaluate(model=lm, tasks=names, task_manager=TaskManager(include_path=tmp),
                                  num_fewshot=num_fewshot, limit=limit, log_samples=log_samples, bootstrap_iters=0)
    if results is None:
        raise RuntimeError("lm_eval.simple_evaluate returned no results")
    return results
