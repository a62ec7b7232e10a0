import pytest
import torch

from griffin import CausalLM, ModelConfig

FAMILIES = ["mqa", "hawk", "griffin"]


def tiny(family, **kw):
    torch.manual_seed(0)
    return CausalLM(ModelConfig.from_preset(f"{family}-tiny", **kw))


@pytest.mark.parametrize("family", FAMILIES)
def test_forward_shapes_and_default_positions(gen, family):
    model = tiny(family)
    ids = torch.randint(0, 32, (3, 21), generator=gen)
    logits = model(ids)
    assert logits.shape == (3, 21, 32)
    torch.testing.assert_close(model(ids, torch.arange(21).expand(3, 21)), logits)


@pytest.mark.parametrize("family", FAMILIES)
@pytest.mark.parametrize("complex_lru", [False, True])
def test_packed_documents_see_nothing_of_each_other(gen, family, complex_lru):
    """A row packing documents A|B|C gives, on each, the logits of that document alone."""
    model = tiny(family, complex_lru=complex_lru).double()
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
def test_backward_is_finite(gen, family, dtype):
    model = tiny(family).to(dtype)
    ids = torch.randint(0, 32, (2, 30), generator=gen)
    loss = torch.nn.functional.cross_entropy(model(ids).float().flatten(0, 1), ids.flatten())
    loss.backward()
    for name, p in model.named_parameters():
        assert p.grad is not None and torch.isfinite(p.grad).all(), name


def test_untied_soft_capped_scaled(gen):
    model = tiny("griffin", tie_embeddings=False, logits_soft_cap=2.0, embed_scale=True)
    logits = model(torch.randint(0, 32, (1, 9), generator=gen))
    assert model.lm_head is not None and logits.abs().max() <= 2.0


def test_bad_input_names_the_value():
    model = tiny("griffin")
    with pytest.raises(ValueError, match="token id 32 is outside the vocabulary \\[0, 32\\)"):
        model(torch.tensor([[1, 32]]))
    with pytest.raises(ValueError, match="token id -1"):
        model(torch.tensor([[-1, 3]]))
    with pytest.raises(TypeError, match="integer tensor, got dtype torch.float32"):
        model(torch.zeros(1, 3))
    with pytest.raises(ValueError, match="shape \\(batch, time\\), got \\(3,\\)"):
        model(torch.tensor([1, 2, 3]))
    with pytest.raises(ValueError, match="positions must have the shape of input_ids \\(1, 3\\), got \\(1, 4\\)"):
        model(torch.tensor([[1, 2, 3]]), torch.arange(4)[None])
    with pytest.raises(ValueError, match=">= 0 \\(or -1 for padding\\), got -2"):
        model(torch.tensor([[1, 2, 3]]), torch.tensor([[0, -2, 1]]))
    with pytest.raises(TypeError, match="positions must be an integer tensor"):
        model(torch.tensor([[1, 2, 3]]), torch.zeros(1, 3))
    with pytest.raises(TypeError, match="input_ids must be a torch.Tensor, got list"):
        model([[1, 2]])
