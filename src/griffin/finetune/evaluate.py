"""Held-out replies generated during a fine-tune: exact-match accuracy and the sample shown at each evaluation.

The reply is decoded greedily with the model's own forward pass and cache (the reference path, which LoRA-wrapped
projections take as they are), from the tokens before an example's last reply. It matches when its first tokens are
the reference reply's, all of them: the reply's text and what closes it (the template's end of turn, or EOS)."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from griffin.data.examples import ExampleSplit
from griffin.model import CausalLM


@dataclass
class ExactMatch:
    accuracy: float
    count: int
    prompt: list[int]  # the first example scored: its prompt, reference reply and greedy reply (the sample)
    reference: list[int]
    reply: list[int]


def reply_span(mask: np.ndarray, prompt: int) -> tuple[int, int]:
    """The reply that starts at token ``prompt``: up to the first token after it that is not a target."""
    end = prompt
    while end < len(mask) and mask[end]:
        end += 1
    return prompt, end


@torch.no_grad()
def greedy_reply(model: CausalLM, prompt: list[int], max_new_tokens: int) -> list[int]:
    """``max_new_tokens`` greedy tokens after ``prompt`` (the model's forward pass with its cache)."""
    device = model.device
    cache = model.init_cache(1, len(prompt) + max_new_tokens)
    logits = model(torch.tensor([prompt], device=device), cache=cache, logits_to_keep=1)
    out: list[int] = []
    for _ in range(max_new_tokens):
        token = int(logits[0, -1].argmax())
        out.append(token)
        if len(out) == max_new_tokens:
            break
        logits = model(torch.tensor([[token]], device=device), cache=cache)
    return out


@torch.no_grad()
def exact_match(model: CausalLM, split: ExampleSplit, limit: int) -> ExactMatch | None:
    """The exact-match accuracy of ``model``'s greedy replies on the first ``limit`` examples of ``split`` that have
    a prompt (chats and pairs trained on their replies); None if there is none."""
    was_training = model.training
    model.eval()
    hits, count, first = 0, 0, None
    try:
        for i in range(len(split)):
            if count == limit:
                break
            prompt_len = int(split.prompts[i])
            if prompt_len <= 0:
                continue
            tokens, mask = split.example(i)
            start, end = reply_span(mask, prompt_len)
            prompt, reference = tokens[:start].tolist(), tokens[start:end].tolist()
            reply = greedy_reply(model, prompt, len(reference))
            hits += reply == reference
            count += 1
            if first is None:
                first = (prompt, reference, reply)
    finally:
        model.train(was_training)
    if first is None:
        return None
    return ExactMatch(hits / count, count, *first)
