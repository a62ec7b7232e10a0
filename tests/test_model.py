import pytest
import torch
import torch.nn.functional as F

from griffin import CausalLM, ModelConfig
from tests.conftest import seed_torch

FAMILIES = ["mqa", "hawk", "griffin"]


def tiny(family, gen, **kw):
    seed_torch(gen)
    return CausalLM(ModelConfig.from_preset(f"{family}-tiny", **kw))


@pytest.mark.parametrize("family", FAMILIES)
def test_forward_shapes_and_default_positions(gen, family):
    model = tiny(family, gen)
    ids = torch.randint(0, 32, (3, 21), generator=gen)
    logits = model(ids)
    assert logits.shape == (3, 21, 32)
    torch.testing.assert_close(model(ids, torch.arange(21).expand(3, 21)), logits)


@pytest.mark.parametrize("family", FAMILIES)
@pytest.mark.parametrize("complex_lru", [False, True])
def test_packed_documents_see_nothing_of_each_other(gen, family, complex_lru):
    """A row packing documents A|B|C gives, on each, the logits of that document alone."""
    model = tiny(family, gen, complex_lru=complex_lru).double()
    lengths = [11, 1, 150]
    docs = [torch.randint(0, 32, (1, n), generator=gen) for n in lengths]
    ids = torch.cat(docs, 1)
    positions = torch.cat([torch.arange(n) for n in lengths])[None]
    packed = model(ids, positions)
    start = 0
    for doc in docs:
        n = doc.shape[1]
        torch.testing.assert_close(packed[:, start : start + n], model(doc))
        start += n


def test_local_window_limits_what_attention_sees(gen):
    """A stack of local-attention blocks sees exactly depth * (window - 1) tokens back."""
    cfg = ModelConfig.from_preset("griffin-tiny", block_types=("local_attention",) * 4)
    model = CausalLM(cfg).double()
    W = cfg.attention_window
    depth = cfg.depth
    ids = torch.randint(0, 32, (1, 40), generator=gen)
    changed = ids.clone()
    changed[0, 0] = (ids[0, 0] + 1) % 32
    a, b = model(ids), model(changed)
    reach = depth * (W - 1)  # receptive field after `depth` windowed layers
    assert (a[0, reach + 1 :] - b[0, reach + 1 :]).abs().max() == 0
    assert (a[0, reach] - b[0, reach]).abs().max() > 0


@pytest.mark.parametrize("family", FAMILIES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("decay", ["init", "extreme", "extreme-complex"])
def test_backward_is_finite(gen, family, dtype, decay):
    """Finite gradients, also where a_t rounds to 1 (Lambda = -200, Section 2.4's bounded sqrt gradient), for the
    RG-LRU and the CG-LRU of Appendix B."""
    model = tiny(family, gen, complex_lru=decay == "extreme-complex").to(dtype)
    if decay != "init":
        with torch.no_grad():
            for name, p in model.named_parameters():
                if name.endswith("a_param"):
                    p.fill_(-200.0)
    ids = torch.randint(0, 32, (2, 30), generator=gen)
    loss = torch.nn.functional.cross_entropy(model(ids).float().flatten(0, 1), ids.flatten())
    loss.backward()
    for name, p in model.named_parameters():
        assert p.grad is not None and torch.isfinite(p.grad).all(), name


@pytest.mark.parametrize("tied", [True, False])
def test_output_layer_soft_capped(gen, tied):
    """logits = cap tanh(final_norm(h) W^T / cap), W the embedding if tied, else the output layer's own matrix; the
    loss (whole or chunked) is the cross-entropy of those logits, and its gradient reaches W."""
    seed_torch(gen)
    model = CausalLM(ModelConfig.from_preset("griffin-tiny", tie_embeddings=tied, logits_soft_cap=2.0,
                                             embed_scale=True))
    head = model.embed.weight if tied else model.lm_head.weight
    assert tied == (not list(model.lm_head.parameters()))  # a tied output layer has no matrix of its own
    captured = []
    model.final_norm.register_forward_hook(lambda module, args, out: captured.append(out))
    ids = torch.randint(0, 16, (2, 9), generator=gen)  # tokens 16..31 never occur in the input
    targets = torch.randint(0, 32, (2, 9), generator=gen)
    logits = model(ids)
    expected = 2.0 * torch.tanh(captured[-1] @ head.T / 2.0)
    torch.testing.assert_close(logits, expected)
    loss = F.cross_entropy(expected.flatten(0, 1), targets.flatten(), reduction="sum")
    torch.testing.assert_close(model(ids, targets=targets), loss)
    chunked = model(ids, targets=targets, loss_chunk=5)
    torch.testing.assert_close(chunked, loss)
    chunked.backward()
    assert head.grad[16:].abs().sum() > 0  # only the output layer uses the rows of tokens absent from the input
    if not tied:
        assert model.embed.weight.grad[16:].abs().sum() == 0


def test_bad_input_names_the_value(gen):
    model = tiny("griffin", gen)
    with pytest.raises(ValueError, match="token id 32 is outside the vocabulary \\[0, 32\\)"):
        model(torch.tensor([[1, 32]]))
    with pytest.raises(ValueError, match="token id -1"):
        model(torch.tensor([[-1, 3]]))
    with pytest.raises(TypeError, match="integer tensor, got dtype torch.float32"):
        model(torch.zeros(1, 3))
    with pytest.raises(ValueError, match="shape \\(batch, time\\) with at least one token, got \\(3,\\)"):
        model(torch.tensor([1, 2, 3]))
    with pytest.raises(ValueError, match="positions must have the shape of input_ids \\(1, 3\\), got \\(1, 4\\)"):
        model(torch.tensor([[1, 2, 3]]), torch.arange(4)[None])
    with pytest.raises(ValueError, match=">= 0 \\(or -1 for padding\\), got -2"):
        model(torch.tensor([[1, 2, 3]]), torch.tensor([[0, -2, 1]]))
    with pytest.raises(TypeError, match="positions must be an integer tensor"):
        model(torch.tensor([[1, 2, 3]]), torch.zeros(1, 3))
    with pytest.raises(TypeError, match="input_ids must be a torch.Tensor, got list"):
        model([[1, 2]])
    for keep in (0, 4, 1.0, True):
        with pytest.raises(ValueError, match=f"logits_to_keep={keep!r} must be None or an int in \\[1, 3\\]"):
            model(torch.tensor([[1, 2, 3]]), logits_to_keep=keep)


def test_logits_to_keep_are_the_last_positions(gen):
    model = tiny("griffin", gen)
    ids = torch.randint(0, 32, (2, 9), generator=gen)
    full = model(ids)
    for keep in (1, 4, 9):
        torch.testing.assert_close(model(ids, logits_to_keep=keep), full[:, -keep:])


@pytest.mark.parametrize("family", FAMILIES)
@torch.no_grad()
def test_forward_updates_the_cache_in_place(gen, family):
    """Every cache tensor keeps its storage (what CUDA graphs and a compiled decode step need)."""
    model = tiny(family, gen).eval()
    cache = model.init_cache(3, 40)
    storage = {k: v.data_ptr() for k, v in cache.tensors().items()}
    before = {k: v.clone() for k, v in cache.tensors().items()}
    model(torch.randint(0, 32, (3, 9), generator=gen), cache=cache)
    model(torch.randint(0, 32, (3, 1), generator=gen), cache=cache)
    assert {k: v.data_ptr() for k, v in cache.tensors().items()} == storage
    assert all(not torch.equal(v, before[k]) for k, v in cache.tensors().items() if k.split(".")[-1] != "segment")


def test_embedding_scale_is_sqrt_width_in_bfloat16(gen):
    model = tiny("griffin", gen, embed_scale=True, width=20, num_heads=5)  # head_dim 4
    assert model.embed_multiplier == 4.46875  # sqrt(20) = 4.472... rounded to bfloat16, as RecurrentGemma
    ids = torch.tensor([[3, 4]])
    torch.testing.assert_close(model.embed_tokens(ids), model.embed(ids) * 4.46875, atol=0, rtol=0)
