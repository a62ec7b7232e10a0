"""The serving engine without HTTP: continuous batching gives each request the tokens it gets alone (and from
``griffin.generate``), prefix-cache hits equal cold requests, sampling, text and the prefix cache against their
references, timeouts, cancellation and back-pressure."""

from __future__ import annotations

import threading
import time

import pytest
import torch

from griffin import generate
from griffin.data.tokenizer import load_tokenizer, train_bpe
from griffin.serve.engine import Engine, QueueFull, chunk_splits
from griffin.serve.prefix_cache import PrefixCache
from griffin.serve.sampling import SamplingParams, choice_generator, sample_rows, sample_rows_reference
from griffin.serve.text import Detokenizer, StopMatcher, detokenize_reference
from tests.serve.conftest import tiny_model

BYTES = load_tokenizer("bytes")


def random_prompt(gen: torch.Generator, lo: int, hi: int) -> list[int]:
    n = int(torch.randint(lo, hi + 1, (1,), generator=gen))
    return torch.randint(0, 256, (n,), generator=gen).tolist()


def run_concurrently(engine: Engine, prompts: list[list[int]], params: list[SamplingParams],
                     delays: list[float]) -> list:
    results = [None] * len(prompts)

    def go(i: int) -> None:
        time.sleep(delays[i])
        results[i] = engine.generate(prompts[i], params[i])

    threads = [threading.Thread(target=go, args=(i,)) for i in range(len(prompts))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=120)
    return results


@pytest.mark.parametrize("preset", ["griffin-tiny", "hawk-tiny", "mqa-tiny"])
def test_rows_joining_a_running_batch_give_the_tokens_of_generate(gen, preset):
    """Greedy requests of different prompt lengths, arriving while others decode (rows at different positions,
    freed and reused), give exactly ``griffin.generate``'s tokens for each prompt alone."""
    model = tiny_model(gen, preset)
    engine = Engine(model, BYTES, max_batch=3, prefill_chunk=8, max_length=128).start()
    try:
        prompts = [random_prompt(gen, 1, 40) for _ in range(6)]
        lengths = [int(torch.randint(1, 24, (1,), generator=gen)) for _ in prompts]
        params = [SamplingParams(max_tokens=n, temperature=0) for n in lengths]
        results = run_concurrently(engine, prompts, params, [0.0, 0.0, 0.01, 0.02, 0.05, 0.05])
        batch_sizes = engine.metrics.histograms["griffin_decode_batch_size"]
        assert sum(batch_sizes.counts[1:]) > 0  # some steps decoded two rows or more at once
        for prompt, n, result in zip(prompts, lengths, results, strict=True):
            alone = generate(model, [prompt], n, temperature=0, max_length=len(prompt) + n)[0]
            assert result.choices[0].token_ids == alone
            assert result.choices[0].finish_reason == "length"
    finally:
        engine.stop()


def test_a_row_inserted_mid_batch_equals_the_row_alone(gen):
    """The same request alone, then inserted while other rows are decoding: the same greedy and seeded tokens."""
    model = tiny_model(gen)
    engine = Engine(model, BYTES, max_batch=4, prefill_chunk=4).start()
    try:
        prompt = random_prompt(gen, 5, 20)
        seed = int(torch.randint(0, 2**31, (1,), generator=gen))
        greedy, seeded = SamplingParams(max_tokens=20, temperature=0), SamplingParams(max_tokens=20, seed=seed)
        alone = [engine.generate(prompt, greedy), engine.generate(prompt, seeded)]
        others = [random_prompt(gen, 1, 30) for _ in range(3)]
        busy = run_concurrently(engine, others + [prompt, prompt],
                                [SamplingParams(max_tokens=40, temperature=0.8)] * 3 + [greedy, seeded],
                                [0.0, 0.0, 0.0, 0.03, 0.06])
        assert busy[3].choices[0].token_ids == alone[0].choices[0].token_ids
        assert busy[4].choices[0].token_ids == alone[1].choices[0].token_ids
        assert generate(model, [prompt], 20, temperature=1.0, seed=seed)[0] == alone[1].choices[0].token_ids
    finally:
        engine.stop()


def test_a_prefix_cache_hit_gives_the_tokens_of_a_cold_request(gen):
    """A conversation's second turn starts from the state kept after the first turn's boundaries: it prefills only
    the new tokens and samples exactly what a server without the cache samples."""
    model = tiny_model(gen)
    warm = Engine(model, BYTES, max_batch=2, prefill_chunk=8).start()
    cold = Engine(model, BYTES, max_batch=2, prefill_chunk=8, prefix_cache_bytes=0).start()
    try:
        system, turn1, turn2 = random_prompt(gen, 20, 40), random_prompt(gen, 3, 12), random_prompt(gen, 3, 12)
        first = system + turn1
        seed = int(torch.randint(0, 2**31, (1,), generator=gen))
        p1 = SamplingParams(max_tokens=5, temperature=0, boundaries=(len(system),))
        warm.generate(first, p1)
        assert warm.prefix_cache.contains(system) and warm.prefix_cache.contains(first)
        second = first + turn2
        # the first: from the state after `first`; the second: from the state after the whole of `second`, whose
        # kept logits give the first token (nothing to prefill)
        for params, cached in ((SamplingParams(max_tokens=12, temperature=0, boundaries=(len(system), len(first))),
                                len(first)),
                               (SamplingParams(max_tokens=12, seed=seed, boundaries=(len(system), len(first))),
                                len(second))):
            computed = warm.metrics.value("griffin_prompt_tokens_computed_total")
            hit = warm.generate(second, params)
            assert hit.prefix_hit == cached
            assert warm.metrics.value("griffin_prompt_tokens_computed_total") - computed == len(second) - cached
            miss = cold.generate(second, params)
            assert miss.prefix_hit == 0
            assert hit.choices[0].token_ids == miss.choices[0].token_ids
        again = warm.generate(second, SamplingParams(max_tokens=12, temperature=0))
        assert again.prefix_hit == len(second)
        assert again.choices[0].token_ids == generate(model, [second], 12, temperature=0)[0]
    finally:
        warm.stop()
        cold.stop()


def test_prompt_logprobs_equal_the_full_forward(gen):
    model = tiny_model(gen)
    engine = Engine(model, BYTES, max_batch=2, prefill_chunk=7).start()
    try:
        prompt = random_prompt(gen, 10, 30)
        out = engine.generate(prompt, SamplingParams(max_tokens=1, temperature=0, logprobs=3, prompt_logprobs=True))
        with torch.no_grad():
            logp = torch.log_softmax(model(torch.tensor([prompt])).float(), -1)[0]
        expected = [None] + [float(logp[i, prompt[i + 1]]) for i in range(len(prompt) - 1)]
        got = [lp.logprob for lp in out.prompt_logprobs]
        assert [lp.token for lp in out.prompt_logprobs] == prompt
        assert got[0] is None
        torch.testing.assert_close(torch.tensor(got[1:]), torch.tensor(expected[1:]), atol=1e-4, rtol=1e-4)
        top = out.prompt_logprobs[5].top
        assert [t for t, _ in top] == logp[4].topk(3).indices.tolist()
        generated = out.choices[0].logprobs[0]
        assert generated.token == int(logp[-1].argmax()) and generated.top[0][0] == generated.token
    finally:
        engine.stop()


def test_chunk_splits_cut_at_every_anchor_and_every_chunk_after_one():
    assert chunk_splits(10, 0, [10], 4) == [4, 8, 10]
    assert chunk_splits(10, 0, [3, 10], 4) == [3, 7, 10]
    assert chunk_splits(10, 3, [3, 10], 4) == [7, 10]  # a hit at an anchor continues on the cold cuts
    assert chunk_splits(10, 10, [10], 4) == []


def test_sample_rows_equals_the_reference_for_greedy_and_seeded_rows(gen):
    logits = torch.randn(7, 50, generator=gen) * 3
    seed = int(torch.randint(0, 2**31, (1,), generator=gen))
    params = [SamplingParams(temperature=0), SamplingParams(temperature=0.7, seed=seed),
              SamplingParams(temperature=1.3, top_p=0.8, seed=seed + 5), SamplingParams(temperature=0),
              SamplingParams(temperature=0.9, top_k=5, seed=seed + 9), SamplingParams(temperature=1.0),
              SamplingParams(temperature=1.0)]
    fast = sample_rows(logits, params, [choice_generator(p, 0) for p in params], torch.Generator().manual_seed(1))
    ref = sample_rows_reference(logits, params, [choice_generator(p, 0) for p in params],
                                torch.Generator().manual_seed(1))
    seeded = [0, 1, 2, 3, 4]
    assert fast[seeded].tolist() == ref[seeded].tolist()
    assert fast[0] == logits[0].argmax() and fast[3] == logits[3].argmax()
    # top-k 5: the sampled token is among the 5 most likely
    assert int(fast[4]) in logits[4].topk(5).indices.tolist()


def test_sampling_params_refuse_bad_values():
    for bad in (dict(temperature=float("nan")), dict(temperature=-1), dict(top_p=0), dict(top_p=1.5),
                dict(max_tokens=-1), dict(n=0), dict(top_k=-2), dict(logprobs=-1), dict(stop=("",))):
        with pytest.raises(ValueError, match=next(iter(bad)) if "stop" not in bad else "stop"):
            SamplingParams(**bad)


def test_detokenizer_adds_up_to_the_whole_decode(gen, tmp_path):
    corpus = tmp_path / "corpus.txt"
    corpus.write_text("the griffin and the hawk fly over the café — naïve 🦅 birds\n" * 50, encoding="utf-8")
    bpe = load_tokenizer(train_bpe([corpus], tmp_path / "tok.json", 300))
    text = "the griffin café — naïve 🦅 hawk"
    for tok in (BYTES, bpe):
        ids = tok.encode(text)
        whole = detokenize_reference(tok, ids)
        for context_len in (0, 3):
            context = detokenize_reference(tok, ids[:context_len])
            d = Detokenizer(tok, ids[:context_len])
            pieces = [d.add(t) for t in ids[context_len:]]
            assert context + "".join(pieces) + d.flush() == whole
            assert all("\ufffd" not in p for p in pieces)  # never half a character
    # random bytes: invalid UTF-8 comes out as U+FFFD, and the pieces add up to the whole
    ids = torch.randint(0, 256, (200,), generator=gen).tolist()
    d = Detokenizer(BYTES)
    assert "".join(d.add(t) for t in ids) + d.flush() == detokenize_reference(BYTES, ids)


def test_stop_matcher_equals_cutting_the_text_at_the_first_complete_stop(gen):
    alphabet = "ab\nc"
    for _ in range(200):
        text = "".join(alphabet[int(i)] for i in torch.randint(0, 4, (30,), generator=gen))
        stops = ["".join(alphabet[int(i)] for i in torch.randint(0, 4, (int(k),), generator=gen))
                 for k in torch.randint(1, 4, (2,), generator=gen)]
        # generation stops as soon as the text so far (pieces of 3) holds a stop sequence, cut where it starts
        cut = -1
        for k in range(3, len(text) + 3, 3):
            found = [i for i in (text[:k].find(s) for s in stops) if i >= 0]
            if found:
                cut = min(found)
                break
        expected = text if cut < 0 else text[:cut]
        m = StopMatcher(stops)
        shown, stopped = "", False
        for i in range(0, len(text), 3):
            piece, stopped = m.add(text[i : i + 3])
            shown += piece
            if stopped:
                break
        if not stopped:
            shown += m.finish()
        assert shown == expected and stopped == (cut >= 0)


def test_prefix_cache_lookup_equals_the_reference_and_stays_in_budget(gen):
    model = tiny_model(gen)
    one = model.init_cache(1)
    logits = torch.zeros(256)
    size = one.nbytes() + logits.numel() * 4
    cache = PrefixCache(max_bytes=3 * size)
    seqs: list[list[int]] = []
    while len(seqs) < 6:  # distinct prompts (storing one again evicts nothing: a short random prompt can repeat)
        if (s := random_prompt(gen, 1, 6)) not in seqs:
            seqs.append(s)
    seqs += [s for s in (seqs[0] + random_prompt(gen, 1, 4), seqs[1] + seqs[2]) if s not in seqs]
    for s in seqs:
        cache.store(s, one, logits)
        assert cache.nbytes <= cache.max_bytes and len(cache) <= 3
    for _ in range(50):
        base = seqs[int(torch.randint(0, len(seqs), (1,), generator=gen))]
        query = base[: int(torch.randint(1, len(base) + 1, (1,), generator=gen))] + random_prompt(gen, 0, 3)
        ref = cache.lookup_reference(query)
        got = cache.lookup(query)
        assert (got is None) == (ref is None) and (got is None or got.length == ref.length)
    assert cache.evictions == len(seqs) - 3


def test_timeouts_cancellation_and_a_full_queue(gen):
    model = tiny_model(gen)
    engine = Engine(model, BYTES, max_batch=1, max_queue=1, prefill_chunk=8).start()
    try:
        long = engine.submit([1, 2, 3], SamplingParams(max_tokens=4000, temperature=0, logprobs=0))
        while engine.running < 1:  # it takes the only row
            time.sleep(0.005)
        queued = engine.submit([4, 5], SamplingParams(max_tokens=2, temperature=0), timeout=0.2)
        with pytest.raises(QueueFull) as err:
            engine.submit([6], SamplingParams(max_tokens=2))
        assert err.value.retry_after >= 1
        updates = list(queued)  # the slot stays taken: it times out in the queue
        assert updates[-1].error and "timed out" in updates[-1].error and updates[-1].status == 503
        long.cancel()
        last = list(long)[-1]
        assert last.done and last.choices[-1].finish_reason == "abort"
        handle = engine.submit([7, 8], SamplingParams(max_tokens=4000, temperature=0), timeout=0.3)
        assert list(handle)[-1].choices[-1].finish_reason == "timeout"
        assert engine.generate([9], SamplingParams(max_tokens=3, temperature=0)).choices[0].finish_reason == "length"
        assert engine.running == 0 and engine.queue_length == 0
    finally:
        engine.stop()
