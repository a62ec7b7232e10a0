"""The griffin model of lm-evaluation-harness: tiny shipped tasks run offline give the accuracies computed by hand;
forked prefix states give the loglikelihoods of separate prefills; generate_until stops at its stop strings."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch
from lm_eval.api.instance import Instance

from griffin import CausalLM, ModelConfig
from griffin.data.tokenizer import ByteTokenizer
from griffin.evaluation.generation import generate_until
from griffin.evaluation.harness import GriffinLM, evaluate_tasks
from griffin.evaluation.loss import reference_token_losses
from tests.conftest import seed_torch

DATA = Path(__file__).with_name("data")


def _model(preset: str, gen: torch.Generator) -> CausalLM:
    seed_torch(gen)
    return CausalLM(ModelConfig.from_preset(preset, vocab_size=256)).eval()


def _ll(model: CausalLM, context: str, continuation: str) -> float:
    """log p(continuation | context) from one full forward pass over the bytes."""
    ctx, cont = list(context.encode()), list(continuation.encode())
    return -float(reference_token_losses(model, ctx + cont)[-len(cont):].sum())


def _jsonl(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


@pytest.fixture(scope="module")
def harness_run():
    gen = torch.Generator().manual_seed(int(torch.randint(0, 2**31, (1,))))
    model = _model("griffin-tiny", gen)
    results = evaluate_tasks(model, ["arc_easy", "winogrande", "phonebook_5"], str(DATA), tokenizer="bytes",
                             batch_size=3, log_samples=True, limit=8)  # phonebook: 8 of 100
    return model, results


def test_multiple_choice_task_matches_hand_computed_acc_and_acc_norm(harness_run):
    model, results = harness_run
    acc, acc_norm, lls = [], [], []
    for doc in _jsonl(DATA / "arc_easy" / "test.jsonl"):
        context = f"Question: {doc['question']}\nAnswer:"
        choices = doc["choices"]["text"]
        ll = np.array([_ll(model, context, " " + c) for c in choices])
        gold = doc["choices"]["label"].index(doc["answerKey"])
        acc.append(float(ll.argmax() == gold))
        acc_norm.append(float((ll / np.array([len(c) for c in choices])).argmax() == gold))  # characters
        lls.append(ll)
    got = results["results"]["arc_easy"]
    assert got["acc,none"] == pytest.approx(np.mean(acc))
    assert got["acc_norm,none"] == pytest.approx(np.mean(acc_norm))
    samples = sorted(results["samples"]["arc_easy"], key=lambda s: s["doc_id"])
    for sample, ll in zip(samples, lls, strict=True):
        np.testing.assert_allclose([r[0][0] for r in sample["resps"]], ll, atol=1e-4)


def test_winogrande_partial_scoring_matches_hand_computed_acc(harness_run):
    model, results = harness_run
    acc = []
    for doc in _jsonl(DATA / "winogrande" / "validation.jsonl"):
        blank = doc["sentence"].index("_")
        continuation = " " + doc["sentence"][blank + 1 :].strip()  # the part after the blank, scored ...
        lls = [_ll(model, doc["sentence"][:blank] + opt, continuation)  # ... after each filled-in prefix
               for opt in (doc["option1"], doc["option2"])]
        acc.append(float(int(np.argmax(lls)) == int(doc["answer"]) - 1))
    assert results["results"]["winogrande"]["acc,none"] == pytest.approx(np.mean(acc))


def test_phonebook_is_a_harness_task(harness_run):
    _, results = harness_run
    samples = results["samples"]["phonebook_5"]
    assert len(samples) == 8
    hits = [float(s["filtered_resps"][0].strip() == s["target"]) for s in samples]
    assert results["results"]["phonebook_5"]["exact_match,none"] == pytest.approx(np.mean(hits))
    assert all("\n" not in s["filtered_resps"][0] for s in samples)  # cut at the first line


@pytest.mark.parametrize("preset", ["griffin-tiny", "hawk-tiny", "mqa-tiny"])
def test_forked_prefix_states_equal_separate_prefills(preset, gen):
    model = _model(preset, gen)
    ids = lambda n: [int(t) for t in torch.randint(0, 256, (n,), generator=gen)]  # noqa: E731
    ctx_a, ctx_b, ctx_c = ids(13), ids(4), ids(9)
    pairs = [(ctx_a, ids(5)), (ctx_b, ids(1)), (ctx_a, ids(1)), (ctx_a, ids(8)), (ctx_c, ids(3)), (ctx_b, ids(6)),
             (ctx_b, ids(2))]
    batched = GriffinLM(model=model, tokenizer="bytes", batch_size=2).score_continuations(pairs)
    alone = GriffinLM(model=model, tokenizer="bytes", batch_size=1)
    for (ctx, cont), (ll, greedy) in zip(pairs, batched, strict=True):
        ll_alone, greedy_alone = alone.score_continuations([(ctx, cont)])[0]
        reference = -float(reference_token_losses(model, ctx + cont)[-len(cont):].sum())
        assert ll == pytest.approx(ll_alone, abs=1e-4) and greedy == greedy_alone
        assert ll == pytest.approx(reference, abs=1e-4)


def test_loglikelihood_rolling_scores_every_token_after_the_prefix(gen):
    model = _model("hawk-tiny", gen)
    lm = GriffinLM(model=model, tokenizer="bytes", batch_size=2, chunk_size=5)
    texts = ["def f(x):\n    return x + 1\n", "import os", "a" * 40]
    got = lm.loglikelihood_rolling([Instance("loglikelihood_rolling", {}, (t,), i) for i, t in enumerate(texts)],
                                   disable_tqdm=True)
    for text, ll in zip(texts, got, strict=True):
        tokens = [lm.prefix_token_id] + list(text.encode())
        assert ll == pytest.approx(-float(reference_token_losses(model, tokens).sum()), abs=1e-4)


def test_generate_until_stops_at_the_stop_strings(gen):
    model = _model("griffin-tiny", gen)
    tok = ByteTokenizer()
    prompts = [list(b"The griffin"), list(b"x = ")]
    free = generate_until(model, prompts, tok, [], 24)
    assert all(len(t.encode("utf-8", "surrogateescape")) == 24 for t in free)  # no stop: max_new_tokens
    for prompt, text in zip(prompts, free, strict=True):
        stop = text[5:7]
        cut = generate_until(model, [prompt], tok, [stop, "\x00never"], 24)[0]
        assert cut == text[: text.index(stop)]
    lm = GriffinLM(model=model, tokenizer="bytes", batch_size=2)
    reqs = [Instance("generate_until", {}, ("The griffin", {"until": [free[0][5:7]], "max_gen_toks": 24}), 0),
            Instance("generate_until", {}, ("x = ", {"until": ["\x00never"], "max_gen_toks": 3}), 1)]
    out = lm.generate_until(reqs, disable_tqdm=True)
    assert out[0] == free[0][: free[0].index(free[0][5:7])]
    assert out[1] == tok.decode(list(free[1].encode("utf-8", "surrogateescape"))[:3])


def test_bad_model_args_are_refused(gen):
    model = _model("hawk-tiny", gen)
    with pytest.raises(ValueError, match="unknown griffin model_args"):
        GriffinLM(model=model, tokenizer="bytes", temperature=3)
    with pytest.raises(ValueError, match="batch_size=0"):
        GriffinLM(model=model, tokenizer="bytes", batch_size=0)
    with pytest.raises(FileNotFoundError, match="no checkpoint at"):
        GriffinLM("does/not/exist")
