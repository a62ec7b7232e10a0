"""Streamed held-out loss (Section 6.1): chunked with the state carried = one full forward pass; per-position loss;
memory flat in the document length for Hawk; clear errors."""

from __future__ import annotations

import math
import subprocess
import sys
import textwrap
from pathlib import Path

import numpy as np
import pytest
import torch

from griffin import CausalLM, ModelConfig
from griffin.data.tokenizer import ByteTokenizer
from griffin.evaluation.loss import (
    check_cache_fits,
    evaluate_loss,
    log_buckets,
    per_position_loss,
    reference_token_losses,
    token_losses,
)
from tests.conftest import seed_torch

FAMILIES = ["hawk-tiny", "griffin-tiny", "mqa-tiny"]


def _model(preset: str, gen: torch.Generator, **overrides) -> CausalLM:
    seed_torch(gen)
    return CausalLM(ModelConfig.from_preset(preset, **overrides)).eval()


def _docs(gen: torch.Generator, lengths, vocab: int = 32) -> list[np.ndarray]:
    return [torch.randint(0, vocab, (n,), generator=gen).numpy() for n in lengths]


@pytest.mark.parametrize("preset", FAMILIES)
def test_streamed_losses_equal_one_full_forward(preset, gen):
    model = _model(preset, gen)
    docs = _docs(gen, [int(n) for n in torch.randint(2, 60, (4,), generator=gen)] + [1, 57])
    chunk = int(torch.randint(1, 9, (1,), generator=gen))  # chunks cross the local-attention window (6)
    for doc, losses in zip(docs, token_losses(model, docs, chunk_size=chunk), strict=True):
        assert losses.shape == (len(doc) - 1,)
        if len(doc) > 1:
            np.testing.assert_allclose(losses, reference_token_losses(model, doc), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("preset", FAMILIES)
def test_chunked_equals_unchunked(preset, gen):
    model = _model(preset, gen)
    docs = _docs(gen, [45, 31, 45])
    whole = token_losses(model, docs, chunk_size=1 << 20)
    for chunk in (1, 5, 16):
        for a, b in zip(token_losses(model, docs, chunk_size=chunk), whole, strict=True):
            np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-5)


def test_evaluate_loss_totals_and_bits_per_byte(gen):
    model = _model("griffin-tiny", gen, vocab_size=256)
    docs = _docs(gen, [40, 9, 23, 2, 1], vocab=256)
    r = evaluate_loss(model, docs, ByteTokenizer(), chunk_size=7, batch_size=2, progress=False)
    nats = sum(reference_token_losses(model, d).sum() for d in docs if len(d) > 1)
    assert (r.documents, r.tokens) == (4, 39 + 8 + 22 + 1)
    assert math.isclose(r.nats, nats, rel_tol=1e-6)
    assert math.isclose(r.mean_loss, nats / r.tokens, rel_tol=1e-6)
    assert math.isclose(r.perplexity, math.exp(r.mean_loss), rel_tol=1e-9)
    assert r.bytes == r.tokens  # one byte per scored token
    assert math.isclose(r.bits_per_byte, r.mean_loss / math.log(2), rel_tol=1e-9)


def test_per_position_loss_means_and_buckets(gen):
    model = _model("hawk-tiny", gen)
    docs = _docs(gen, [50, 12, 64, 40, 3])
    r = per_position_loss(model, docs, 40, chunk_size=6, batch_size=2, num_buckets=6, progress=False)
    assert (r.documents, r.short_documents, r.short_lengths) == (3, 2, [3, 12])
    rows = np.stack([reference_token_losses(model, d[:40]) for d in docs if len(d) >= 40])
    np.testing.assert_allclose(r.position_loss, rows.mean(0), rtol=1e-5, atol=1e-6)
    edges = log_buckets(40, 6)
    assert r.bucket_start[0] == 1 and r.bucket_end[-1] == 40 and list(edges[1:-1]) == r.bucket_start[1:]
    for a, b, loss in zip(r.bucket_start, r.bucket_end, r.bucket_loss, strict=True):
        assert math.isclose(loss, rows[:, a - 1 : b - 1].mean(), rel_tol=1e-6)


def test_per_position_refuses_data_shorter_than_max_length(gen):
    model = _model("hawk-tiny", gen)
    with pytest.raises(ValueError, match=r"no document has --max-length=100 tokens \(the longest of 2 has 30\)"):
        per_position_loss(model, _docs(gen, [30, 20]), 100, progress=False)


def test_bad_tokens_and_oversized_kv_cache_are_refused(gen):
    model = _model("mqa-tiny", gen)
    with pytest.raises(ValueError, match="token id 40 outside the vocabulary"):
        token_losses(model, [np.array([1, 40, 2])])
    with pytest.raises(ValueError, match=r"global-attention KV cache for 1 document\(s\) of 1,000,000,000,000 tokens"):
        check_cache_fits(model, 1, 10**12)
    check_cache_fits(_model("hawk-tiny", gen), 1, 10**12)  # no KV cache: nothing to check


MEMORY_SCRIPT = textwrap.dedent("""
    import sys
    import numpy as np, torch
    from griffin import CausalLM, ModelConfig
    from griffin.evaluation.loss import token_losses, reference_token_losses
    torch.manual_seed(int(sys.argv[1])); torch.set_num_threads(1)
    model = CausalLM(ModelConfig.from_preset("hawk-tiny", vocab_size=256, width=32, rnn_width=48)).eval()
    rng = np.random.default_rng(int(sys.argv[1]))
    def status(field):
        with open("/proc/self/status") as f:
            return next(int(line.split()[1]) for line in f if line.startswith(field + ":")) / 1024  # MiB
    def growth(fn, *args, **kwargs):
        # the peak resident memory during fn over the resident memory just before it: the kernel's peak (VmHWM)
        # is reset first, so pages reclaimed between phases (a shared host under memory pressure) cannot hide it
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
        before = status("VmRSS")
        fn(*args, **kwargs)
        return status("VmHWM") - before
    token_losses(model, [rng.integers(0, 256, 4096)], chunk_size=256)  # warm up
    short = growth(token_losses, model, [rng.integers(0, 256, 4096)], chunk_size=256)
    long = growth(token_losses, model, [rng.integers(0, 256, 2048 * 32)], chunk_size=256)
    full = growth(reference_token_losses, model, rng.integers(0, 256, 2048 * 32))
    print(long - short, full)
""")


@pytest.mark.skipif(not Path("/proc/self/clear_refs").exists(), reason="needs Linux's resettable peak RSS")
def test_hawk_memory_is_flat_in_the_document_length(gen):
    """Streaming a document 16x longer raises the peak memory by almost nothing; one full forward pass of it (the
    control: the measurement sees growth) by far more."""
    seed = int(torch.randint(0, 2**31, (1,), generator=gen))
    out = subprocess.run([sys.executable, "-c", MEMORY_SCRIPT, str(seed)], capture_output=True, text=True,
                         timeout=300, check=True)
    streamed, full = map(float, out.stdout.split())
    assert streamed < 8, f"streaming a 64K-token document raised the peak by {streamed:.1f} MiB"
    assert full > 50, f"the control (a full forward pass) raised the peak by only {full:.1f} MiB"
