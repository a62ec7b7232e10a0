import pytest

from griffin import PRESETS, ModelConfig, count_parameters
from griffin.config import PAPER_SIZES


def test_family_patterns():
    assert ModelConfig(family="mqa", depth=3).block_types == ("attention",) * 3
    assert ModelConfig(family="hawk", depth=3).block_types == ("recurrent",) * 3
    griffin = ModelConfig.from_preset("griffin-synthetic")
    assert griffin.block_types == ("recurrent", "recurrent", "local_attention", "recurrent", "recurrent")


@pytest.mark.parametrize("size", list(PAPER_SIZES))
def test_paper_presets_match_appendix_c(size):
    width, rnn_width, depth, heads = PAPER_SIZES[size]
    for family in ("mqa", "hawk", "griffin"):
        c = ModelConfig.from_preset(f"{family}-{size}")
        assert (c.width, c.rnn_width, c.depth, c.num_heads, c.head_dim) == (width, rnn_width, depth, heads, 128)
        assert c.mlp_width == 3 * width and c.num_kv_heads == 1 and c.gate_blocks == 16
        assert c.rg_lru_c == 8.0 and c.conv1d_width == 4 and c.a_init_range == (0.9, 0.999)


@pytest.mark.parametrize(
    "name,nominal,tolerance",
    [("griffin-14b", 14e9, 0.1), ("hawk-7b", 7e9, 0.1), ("griffin-1.3b", 1.3e9, 0.1), ("mqa-100m", 100e6, 0.1),
     ("recurrentgemma-2b", 2.68e9, 0.01), ("recurrentgemma-9b", 8.58e9, 0.01),
     ("griffin-synthetic", 250e3, 0.1), ("hawk-synthetic", 250e3, 0.1)],
)
def test_parameter_counts_near_nominal(name, nominal, tolerance):
    n = count_parameters(ModelConfig.from_preset(name))
    assert abs(n - nominal) / nominal < tolerance, n


def test_tiny_presets_are_tiny():
    for family in ("mqa", "hawk", "griffin"):
        assert count_parameters(ModelConfig.from_preset(f"{family}-tiny")) < 20_000


def test_recurrentgemma_presets():
    c = ModelConfig.from_preset("recurrentgemma-2b")
    assert c.embed_scale and c.logits_soft_cap == 30.0 and c.attention_window == 2048
    assert c.head_dim == 256 and c.num_kv_heads == 1 and c.vocab_size == 256_000


def test_dict_round_trip(tmp_path):
    for name in PRESETS:
        c = ModelConfig.from_preset(name)
        c.save(tmp_path / "c.json")
        assert ModelConfig.load(tmp_path / "c.json") == c


@pytest.mark.parametrize(
    "kwargs,needle",
    [
        (dict(width=30, num_heads=4), "width=30"),
        (dict(rnn_width=50, gate_blocks=16), "gate_blocks=16"),
        (dict(family="rwkv"), "family='rwkv'"),
        (dict(depth=0), "depth=0"),
        (dict(block_types=("recurrent", "mlp"), depth=2), "block_types[1]='mlp'"),
        (dict(depth=3, block_types=("recurrent",)), "depth=3"),
        (dict(num_heads=4, num_kv_heads=3, head_dim=16), "num_kv_heads=3"),
        (dict(a_init_range=(0.9, 1.0)), "a_init_range"),
        (dict(logits_soft_cap=-1.0), "logits_soft_cap=-1.0"),
        (dict(gelu_approximation="relu"), "gelu_approximation='relu'"),
        (dict(head_dim=7), "head_dim=7"),
    ],
)
def test_invalid_configs_name_the_value(kwargs, needle):
    with pytest.raises(ValueError) as err:
        ModelConfig(**kwargs)
    assert needle in str(err.value)


def test_unknown_preset_and_keys():
    with pytest.raises(ValueError, match="unknown preset 'griffin-1t'"):
        ModelConfig.from_preset("griffin-1t")
    with pytest.raises(ValueError, match="unknown ModelConfig keys: \\['colour'\\]"):
        ModelConfig.from_dict({"colour": "red"})
