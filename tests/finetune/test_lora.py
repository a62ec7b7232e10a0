"""LoRA (griffin.finetune.lora, griffin.interop.adapters): the adapted model starts as the base model, its gradients are
the full model's through the adapter, merging computes what the adapter did, the files are PEFT's (PEFT loads
griffin's adapters onto the HF export, griffin loads PEFT's), adapters that do not fit are refused by name, and the
command line's merge and --adapter agree."""

import json
import math
from copy import deepcopy

import pytest
import torch
import transformers
from peft import LoraConfig, PeftModel, get_peft_model
from peft.tuners.lora import LoraLayer

from griffin import CausalLM, ModelConfig, load_pretrained, save_pretrained
from griffin.cli import _printable, main
from griffin.data.tokenizer import ByteTokenizer
from griffin.finetune.lora import apply_lora, lora_layers, lora_pairs, merge_lora, read_lora, save_lora
from griffin.inference.generate import generate
from griffin.interop import CheckpointError, export_hf
from griffin.interop.adapters import (
    ADAPTER_CONFIG,
    ADAPTER_WEIGHTS,
    AdapterError,
    LoraSettings,
    linear_modules,
    merge_adapter,
    read_adapter,
    resolve_targets,
)
from griffin.io import read_safetensors
from griffin.loading import load_for_use
from griffin.quantize import quantization_of, quantize_int8
from tests.conftest import max_relative_error, perturb_, seed_torch

FAMILIES = ["hawk", "griffin", "mqa"]
T = 20  # longer than the tiny presets' attention window (6)
SETTINGS = LoraSettings(4, 8.0)  # scale alpha / r = 2
# float32 logits (of magnitude ~4 here) through an adapter and through its merged weights: the same sums, rounded in
# another order, ~1e-6 apart (2.6e-6 at most seen).
F32 = {"rtol": 0.0, "atol": 1e-5}


def tiny_config(family: str, **overrides) -> ModelConfig:
    """A tiny preset; Hawk's and Griffin's with RecurrentGemma's settings, so that they export to HF (MQA's global
    attention has no HF counterpart)."""
    if family == "mqa":
        return ModelConfig.from_preset("mqa-tiny", **overrides)
    hf = {"embed_scale": True, "logits_soft_cap": 30.0, "conv1d_document_reset": False}
    if family == "griffin":
        hf["gate_blocks"] = 2
    return ModelConfig.from_preset(f"{family}-tiny", **{**hf, **overrides})


def base_model(gen, family: str = "griffin", dtype: torch.dtype = torch.float32, **overrides) -> CausalLM:
    seed_torch(gen)
    model = CausalLM(tiny_config(family, **overrides))
    perturb_(model, gen)
    return model.to(dtype).eval()


@torch.no_grad()
def randomize_b_(model: torch.nn.Module, gen: torch.Generator, std: float = 0.1) -> None:
    """Draw every adapter's B (zero at initialisation), so that the adapters change what the model computes."""
    for _, b in lora_pairs(model).values():
        b.copy_(torch.randn(b.shape, generator=gen, dtype=torch.float64) * std)


def adapted(gen, base: CausalLM, targets="all", settings: LoraSettings = SETTINGS, std: float = 0.1) -> CausalLM:
    """A copy of ``base`` with trained-looking adapters (B drawn)."""
    model = deepcopy(base)
    apply_lora(model, settings, targets)
    randomize_b_(model, gen, std)
    return model


def token_ids(gen, config: ModelConfig, batch: int = 2) -> torch.Tensor:
    return torch.randint(0, config.vocab_size, (batch, T), generator=gen)


def hf_model(directory) -> transformers.RecurrentGemmaForCausalLM:
    return transformers.RecurrentGemmaForCausalLM.from_pretrained(directory, dtype=torch.float32).eval()


def error(weight: torch.Tensor, exact: torch.Tensor) -> torch.Tensor:
    return (weight.double() - exact).abs()


def float32_slack(w: torch.Tensor, a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """A bound on float32's rounding in computing W + 2 B A before the result is rounded to a narrower float: where
    the two nearly cancel, it exceeds that rounding of the (small) result."""
    return 2.0**-20 * (w.abs() + 2.0 * b.double().abs() @ a.double().abs())


def edit_config(directory, **fields) -> None:
    path = directory / ADAPTER_CONFIG
    path.write_text(json.dumps({**json.loads(path.read_text()), **fields}))


# 1. At initialisation ------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("family", FAMILIES)
@torch.no_grad()
def test_lora_starts_as_the_base_model(gen, family, dtype):
    model = base_model(gen, family, dtype)
    ids = token_ids(gen, model.config)
    targets = ids.roll(-1, 1)
    logits, loss = model(ids), model(ids, targets=targets)
    names = apply_lora(model, SETTINGS, "all")
    assert set(names) == set(linear_modules(model.config)) == set(lora_layers(model))
    trainable = {name: p for name, p in model.named_parameters() if p.requires_grad}
    assert set(trainable) == {f"{m}.lora_{x}.default.weight" for m in names for x in "AB"}  # the rest frozen
    assert all(p.dtype == torch.float32 for p in trainable.values())
    for a, b in lora_pairs(model).values():
        assert a.abs().min() > 0 and not b.any()  # A drawn, B zero
    assert model.dtype == dtype
    assert torch.equal(model(ids), logits)
    assert torch.equal(model(ids, targets=targets), loss)


# 2. Gradients --------------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("rslora", [False, True])
def test_lora_gradients_are_the_full_models_through_the_adapter(gen, rslora):
    """With W' = W + s B A: dL/dA = s B^T dL/dW' and dL/dB = s dL/dW' A^T, dL/dW' the merged plain model's gradient,
    in float64 (s = alpha / r, alpha / sqrt(r) with rsLoRA)."""
    base = base_model(gen, "griffin", torch.float64)
    r, alpha = 3, 5.0
    scale = alpha / (math.sqrt(r) if rslora else r)
    model = deepcopy(base)
    names = apply_lora(model, LoraSettings(r, alpha, rslora=rslora), ["attention", "mlp", "linear_x", "linear_out"])
    assert {n.rsplit(".", 1)[-1] for n in names} == {"proj_q", "proj_k", "proj_v", "proj_final", "gate_proj",
                                                     "up_proj", "down_proj", "linear_x", "linear_out"}
    for layer in lora_layers(model).values():  # the adapters are float32: make them float64 too
        layer.lora_A.double()
        layer.lora_B.double()
    randomize_b_(model, gen, 0.3)
    ids = token_ids(gen, model.config)
    targets = ids.roll(-1, 1)
    targets[0, :5] = -100  # not counted
    loss = model(ids, targets=targets)
    loss.backward()
    merged = deepcopy(base).requires_grad_(True)
    pairs = lora_pairs(model)
    with torch.no_grad():
        for name, (a, b) in pairs.items():
            merged.get_submodule(name).weight += scale * b @ a
    merged_loss = merged(ids, targets=targets)
    merged_loss.backward()
    assert abs(loss.item() - merged_loss.item()) <= 1e-12 * merged_loss.item()
    for name, (a, b) in pairs.items():
        grad = merged.get_submodule(name).weight.grad
        assert max_relative_error(a.grad, scale * b.T @ grad) <= 1e-9, name
        assert max_relative_error(b.grad, scale * grad @ a.T) <= 1e-9, name
    assert all(p.grad is None for name, p in model.named_parameters() if ".lora_" not in name)


# 3. Merging ----------------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("family", FAMILIES)
@torch.no_grad()
def test_merged_adapter_computes_what_the_adapter_did(gen, tmp_path, family):
    base = base_model(gen, family)
    save_pretrained(base, tmp_path / "base")
    model = adapted(gen, base)
    ids = token_ids(gen, base.config)
    expected = model(ids)
    assert (expected - base(ids)).abs().max() > 0.1  # the adapter matters, far beyond the tolerance
    save_lora(model, tmp_path / "adapter", str(tmp_path / "base"))
    config = json.loads((tmp_path / "adapter" / ADAPTER_CONFIG).read_text())
    assert (config["peft_type"], config["r"], config["lora_alpha"]) == ("LORA", 4, 8.0)
    assert config["base_model_name_or_path"] == str(tmp_path / "base")
    # In place: the plain projections are back, with the model's own parameter names.
    in_place = merge_lora(deepcopy(model))
    assert not lora_layers(in_place) and in_place.state_dict().keys() == base.state_dict().keys()
    torch.testing.assert_close(in_place(ids), expected, **F32)
    # From the files: into a model, with load_pretrained's adapter=, and the adapter directory loading its base.
    into = deepcopy(base)
    merge_adapter(into, tmp_path / "adapter")
    for merged in (into, load_pretrained(tmp_path / "base", adapter=tmp_path / "adapter"),
                   load_pretrained(tmp_path / "adapter")):
        torch.testing.assert_close(merged(ids), expected, **F32)
        for name in lora_layers(model):
            torch.testing.assert_close(merged.get_submodule(name).weight, in_place.get_submodule(name).weight,
                                       rtol=0, atol=1e-6)


@torch.no_grad()
def test_merging_into_a_bfloat16_base_rounds_once(gen, tmp_path):
    base = base_model(gen, "griffin", torch.bfloat16)
    save_pretrained(base, tmp_path / "base")
    model = adapted(gen, base)  # float32 adapters on the bfloat16 model
    save_lora(model, tmp_path / "adapter", str(tmp_path / "base"))
    # The float32 reference: the bfloat16 weights plus the update, exactly.
    reference, exact, slack = deepcopy(base).float(), {}, {}
    for name, (a, b) in lora_pairs(model).items():
        w = base.get_submodule(name).weight.double()
        exact[name] = w + 2.0 * b.double() @ a.double()
        slack[name] = float32_slack(w, a, b)
        reference.get_submodule(name).weight.copy_(exact[name])
    merged = load_pretrained(tmp_path / "base", adapter=tmp_path / "adapter")
    assert merged.dtype == torch.bfloat16
    for name, w in exact.items():  # rounded to bfloat16 once: within half a unit in the last place
        assert (error(merged.get_submodule(name).weight, w) <= w.abs() * 2.0**-8 + slack[name]).all(), name
    ids = token_ids(gen, base.config)
    expected = reference(ids)
    assert (expected - base.float()(ids)).abs().max() > 1.0  # the adapter matters, far beyond bfloat16's rounding
    # bfloat16 activations through 4 blocks: ~1% of the logits' scale off the float32 reference (2^-5 allowed).
    tolerance = 2.0**-5 * expected.abs().max()
    for logits in (model(ids), merged(ids), merge_lora(deepcopy(model))(ids)):
        assert logits.dtype == torch.bfloat16
        assert (logits.float() - expected).abs().max() <= tolerance


@torch.no_grad()
def test_a_float16_base_accepts_its_own_adapter(gen, tmp_path):
    """The base fingerprint is to be the same in any float dtype: float16 weights are the float32 ones rounded."""
    base = base_model(gen)
    save_pretrained(base, tmp_path / "base")
    model = adapted(gen, base)
    save_lora(model, tmp_path / "adapter", str(tmp_path / "base"))
    merged = load_pretrained(tmp_path / "base", dtype=torch.float16, adapter=tmp_path / "adapter")
    for name, (a, b) in lora_pairs(model).items():  # within two float16 roundings (of W, then of the sum)
        w = base.get_submodule(name).weight.double()
        exact = w + 2.0 * b.double() @ a.double()
        bound = (w.abs() + exact.abs()) * 2.0**-11 + 2.0**-24 + float32_slack(w, a, b)  # (and subnormals')
        assert (error(merged.get_submodule(name).weight, exact) <= bound).all(), name
    ids = token_ids(gen, base.config)
    expected = model(ids)
    assert (merged(ids).float() - expected).abs().max() <= 2.0**-7 * expected.abs().max()


# 4-5. PEFT -----------------------------------------------------------------------------------------------------------
@pytest.mark.parametrize(("family", "targets"), [("griffin", "all"), ("griffin", "attention"), ("griffin", "mlp"),
                                                 ("hawk", "recurrent")])
@torch.no_grad()
def test_peft_loads_griffins_adapters_onto_the_hf_export(gen, tmp_path, family, targets):
    base = base_model(gen, family)
    export_hf(base, tmp_path / "hf")
    model = adapted(gen, base, targets)
    save_lora(model, tmp_path / "adapter", str(tmp_path / "hf"))
    ids = token_ids(gen, base.config)
    expected = model(ids)
    peft_model = PeftModel.from_pretrained(hf_model(tmp_path / "hf"), tmp_path / "adapter").eval()
    hf_names = [linear_modules(base.config)[name] for name in lora_layers(model)]
    assert {name for name, m in peft_model.named_modules() if isinstance(m, LoraLayer)} == {
        "base_model.model." + name for name in hf_names}
    torch.testing.assert_close(peft_model(ids, use_cache=False).logits, expected, **F32)
    # PEFT's merge and griffin's (of the adapter onto the HF checkpoint) agree, weight by weight.
    peft_merged = peft_model.merge_and_unload()
    ours = load_pretrained(tmp_path / "hf", adapter=tmp_path / "adapter")
    torch.testing.assert_close(peft_merged(ids, use_cache=False).logits, ours(ids), **F32)
    export_hf(ours, tmp_path / "merged")
    ours_state = read_safetensors(tmp_path / "merged" / "model.safetensors")[0]
    theirs_state = peft_merged.state_dict()
    for name in hf_names:
        torch.testing.assert_close(ours_state[name + ".weight"], theirs_state[name + ".weight"], rtol=0, atol=1e-6)


@torch.no_grad()
def test_an_adapter_peft_writes_loads_into_griffin(gen, tmp_path):
    base = base_model(gen, "griffin")
    save_pretrained(base, tmp_path / "griffin")
    export_hf(base, tmp_path / "hf")
    peft_model = get_peft_model(hf_model(tmp_path / "hf"), LoraConfig(
        r=4, lora_alpha=6.0, use_rslora=True, target_modules=["q_proj", "o_proj", "linear_y", "up_proj"])).eval()
    b = [p for name, p in peft_model.named_parameters() if "lora_B" in name]
    assert len(b) == 4 + 3 + 1 + 1  # up_proj: 4 blocks, linear_y: 3 recurrent ones, q_proj and o_proj: 1 attention
    for p in b:
        p.copy_(torch.randn(p.shape, generator=gen) * 0.1)
    peft_model.save_pretrained(tmp_path / "adapter")
    ids = token_ids(gen, base.config)
    expected = peft_model(ids, use_cache=False).logits
    assert (expected - base(ids)).abs().max() > 0.1
    adapter = read_adapter(tmp_path / "adapter", base.config)
    assert adapter.fingerprint is None and adapter.settings.scale == 6.0 / 2.0  # rsLoRA: alpha / sqrt(r)
    assert len(adapter.pairs) == 9
    for model in (load_pretrained(tmp_path / "hf", adapter=tmp_path / "adapter"),
                  load_pretrained(tmp_path / "griffin", adapter=tmp_path / "adapter"),
                  load_pretrained(tmp_path / "adapter")):  # the base PEFT names: the HF directory
        torch.testing.assert_close(model(ids), expected, **F32)


# 6. Refusals ---------------------------------------------------------------------------------------------------------
@torch.no_grad()
def test_an_adapter_trained_on_another_base_model_is_refused(gen, tmp_path):
    base, other = base_model(gen), base_model(gen)  # the same shapes, other weights
    save_pretrained(base, tmp_path / "base")
    save_pretrained(other, tmp_path / "other")
    save_lora(adapted(gen, base), tmp_path / "adapter", str(tmp_path / "base"))
    refusal = f"the adapter {tmp_path / 'adapter'} was trained on another base model ({tmp_path / 'base'})"
    with pytest.raises(AdapterError, match="fingerprint") as err:
        merge_adapter(deepcopy(other), tmp_path / "adapter")
    assert refusal in str(err.value)
    with pytest.raises(AdapterError) as err:
        load_pretrained(tmp_path / "other", adapter=tmp_path / "adapter")
    assert refusal in str(err.value)
    resumed = deepcopy(other)
    apply_lora(resumed, SETTINGS, "all")
    with pytest.raises(AdapterError) as err:  # the checkpoint hook: resuming a LoRA run onto another base
        read_lora(tmp_path / "adapter", resumed)
    assert refusal in str(err.value)
    # The same weights in another dtype or format are the same base.
    load_pretrained(tmp_path / "base", dtype=torch.bfloat16, adapter=tmp_path / "adapter")
    export_hf(base, tmp_path / "hf")
    load_pretrained(tmp_path / "hf", adapter=tmp_path / "adapter")
    resumed = deepcopy(base)
    apply_lora(resumed, SETTINGS, "all")
    read_lora(tmp_path / "adapter", resumed)
    saved = read_adapter(tmp_path / "adapter", base.config).pairs
    for name, (a, b) in lora_pairs(resumed).items():
        assert torch.equal(a, saved[name][0]) and torch.equal(b, saved[name][1])


@pytest.mark.parametrize(("other", "named"), [
    ({"width": 24}, "model.layers.0.mlp_block.down_proj: lora_A (4, 48) and lora_B (16, 4) do not fit a 72 -> 24 "
                    "layer at rank 4"),
    ({"depth": 2}, "model.layers.3.mlp_block.up_proj: no such layer in this model (a griffin of depth 2)"),
    ({"family": "hawk"}, "model.layers.2.temporal_block.q_proj: no such layer in this model (a hawk of depth 4)"),
])
@torch.no_grad()
def test_an_adapter_of_another_shape_is_refused_naming_the_module(gen, tmp_path, other, named):
    base = base_model(gen)
    save_lora(adapted(gen, base), tmp_path / "adapter", "")
    other_model = base_model(gen, **other)
    for refuse in (lambda: merge_adapter(other_model, tmp_path / "adapter"),
                   lambda: read_adapter(tmp_path / "adapter", other_model.config)):
        with pytest.raises(AdapterError, match="does not fit this model") as err:
            refuse()
        assert named in str(err.value)


@pytest.mark.parametrize("rank", [0, -2])
def test_a_rank_that_is_not_positive_is_refused(gen, tmp_path, rank):
    model = base_model(gen)
    with pytest.raises(ValueError, match=f"LoRA rank {rank} must be a positive integer"):
        apply_lora(model, LoraSettings(rank, 8.0), "all")
    assert not lora_layers(model) and all(p.requires_grad for p in model.parameters())  # left as it was
    save_lora(adapted(gen, model), tmp_path / "adapter", "")
    edit_config(tmp_path / "adapter", r=rank)
    with pytest.raises(AdapterError, match=f"r={rank} must be positive"):
        merge_adapter(model, tmp_path / "adapter")


def test_a_rank_larger_than_a_target_layer_is_refused(gen):
    model = base_model(gen)
    with pytest.raises(ValueError, match=r"LoRA rank 9 exceeds the layer blocks\.2\.temporal_block\.proj_k "
                                         r"\(16 -> 8\): a rank above 8 adds nothing"):
        apply_lora(model, LoraSettings(9, 8.0), "all")
    assert not lora_layers(model) and all(p.requires_grad for p in model.parameters())  # left as it was
    assert len(apply_lora(model, LoraSettings(9, 8.0), "mlp,q_proj")) == 4 * 3 + 1  # 16 -> 16 and wider: 9 fits


def test_unknown_and_unmatched_targets_are_refused():
    griffin, hawk = tiny_config("griffin"), tiny_config("hawk")
    with pytest.raises(ValueError, match=r"unknown LoRA target module 'q_projj'; did you mean \['q_proj'") as err:
        resolve_targets(griffin, "mlp, q_projj")
    assert "targets: all, attention (q_proj, k_proj, v_proj, o_proj); mlp (" in str(err.value)
    with pytest.raises(ValueError, match=r"unknown LoRA target module 'mpl'; did you mean \['mlp'\]"):
        apply_lora(CausalLM(griffin), SETTINGS, ["mpl"])
    with pytest.raises(ValueError, match="no LoRA target modules given"):
        resolve_targets(griffin, " , ")
    with pytest.raises(ValueError, match=r"LoRA targets \['q_proj'\] match no layer of this hawk model \(blocks: "
                                         r"recurrent\)"):
        resolve_targets(hawk, "q_proj")
    # Refused only when none matches: a Griffin recipe's targets adapt what Hawk has.
    assert resolve_targets(hawk, "q_proj,linear_x") == [f"blocks.{i}.temporal_block.linear_x" for i in range(4)]
    assert resolve_targets(griffin, "proj_q") == resolve_targets(griffin, "q_proj") == [
        "blocks.2.temporal_block.proj_q"]  # griffin's names too


@pytest.mark.parametrize(("fields", "named"), [
    ({"use_dora": True}, "griffin merges plain LoRA only; this adapter has use_dora=True"),
    ({"bias": "lora_only"}, "griffin merges plain LoRA only; this adapter has bias='lora_only'"),
    ({"bias": "all", "modules_to_save": ["lm_head"]}, "modules_to_save=['lm_head'], bias='all'"),
    ({"peft_type": "IA3"}, "not a LoRA adapter (peft_type 'IA3')"),
    # PEFT's variants with a plain adapter's tensors (or some more) that merging would silently get wrong
    ({"lora_bias": True}, "griffin merges plain LoRA only; this adapter has lora_bias=True"),
    ({"alora_invocation_tokens": [3, 4]}, "this adapter has alora_invocation_tokens=[3, 4]"),
])
@torch.no_grad()
def test_adapters_griffin_cannot_merge_are_refused(gen, tmp_path, fields, named):
    base = base_model(gen)
    save_lora(adapted(gen, base), tmp_path / "adapter", "")
    merge_adapter(deepcopy(base), tmp_path / "adapter")  # as written: merges
    edit_config(tmp_path / "adapter", **fields)
    with pytest.raises(AdapterError) as err:
        merge_adapter(deepcopy(base), tmp_path / "adapter")
    assert named in str(err.value)


def test_an_adapter_missing_its_weights_or_its_base_is_refused(gen, tmp_path):
    base = base_model(gen)
    save_pretrained(base, tmp_path / "base")
    save_lora(adapted(gen, base), tmp_path / "adapter", str(tmp_path / "base"))
    (tmp_path / "adapter" / ADAPTER_WEIGHTS).unlink()
    for load in (lambda: load_pretrained(tmp_path / "base", adapter=tmp_path / "adapter"),
                 lambda: load_pretrained(tmp_path / "adapter")):
        with pytest.raises(FileNotFoundError, match=f"has {ADAPTER_CONFIG} but no {ADAPTER_WEIGHTS}"):
            load()
    save_lora(adapted(gen, base), tmp_path / "moved", str(tmp_path / "gone"))
    with pytest.raises(CheckpointError, match=f"whose base model {tmp_path / 'gone'} is not here"):
        load_pretrained(tmp_path / "moved")
    with pytest.raises(ValueError, match="is itself a LoRA adapter"):
        load_pretrained(tmp_path / "moved", adapter=tmp_path / "moved")


@torch.no_grad()
def test_decoding_an_unmerged_lora_model_is_refused_naming_the_merge(gen):
    """The decoder swaps the projections for its own matmuls, which would drop the adapters: refused, not wrong."""
    from griffin.inference.generate import generate

    model = adapted(gen, base_model(gen))
    with pytest.raises(ValueError, match="the model holds LoRA adapters: merge them"):
        generate(model, [[1, 2, 3]], 4, temperature=0.0)
    assert len(generate(merge_lora(model), [[1, 2, 3]], 4, temperature=0.0)[0]) == 4


def test_an_int8_model_is_refused_for_merging(gen, tmp_path):
    base = base_model(gen)
    save_pretrained(base, tmp_path / "base")
    save_lora(adapted(gen, base), tmp_path / "adapter", str(tmp_path / "base"))
    int8 = quantize_int8(deepcopy(base))
    with pytest.raises(AdapterError, match="the model holds int8 weights: merge the adapter into the float "
                                           "checkpoint, then quantise"):
        merge_adapter(int8, tmp_path / "adapter")
    # Loading for use merges into the float weights first, then quantises.
    loaded = load_for_use(tmp_path / "base", tokenizer=None, quantize="int8", adapter=tmp_path / "adapter")
    expected = quantize_int8(load_pretrained(tmp_path / "adapter"))
    assert quantization_of(loaded.model) is not None
    assert torch.equal(loaded.model.state_dict()["blocks.0.mlp_block.up_proj.weight"],
                       expected.state_dict()["blocks.0.mlp_block.up_proj.weight"])


# 7. Command line -----------------------------------------------------------------------------------------------------
@torch.no_grad()
def test_cli_merge_generates_what_generate_with_the_adapter_does(gen, tmp_path, capsys):
    base = base_model(gen, vocab_size=256)  # byte-level
    save_pretrained(base, tmp_path / "base")
    model = adapted(gen, base, std=0.3)
    save_lora(model, tmp_path / "adapter", str(tmp_path / "base"))
    assert main(["merge", str(tmp_path / "adapter"), str(tmp_path / "merged")]) == 0
    assert f"with the adapter {tmp_path / 'adapter'} merged" in capsys.readouterr().out
    prompt, n = "the cat", 16
    merged = deepcopy(base)
    merge_adapter(merged, tmp_path / "adapter")
    tokens = generate(merged, [list(prompt.encode())], n, temperature=0.0)[0]
    expected = prompt + _printable(ByteTokenizer().decode(tokens), final=True) + "\n"
    flags = ["--prompt", prompt, "--temperature", "0", "--max-new-tokens", str(n)]
    for checkpoint in ([str(tmp_path / "merged")], [str(tmp_path / "base"), "--adapter", str(tmp_path / "adapter")],
                       [str(tmp_path / "adapter")]):
        assert main(["generate", *checkpoint, *flags]) == 0
        assert capsys.readouterr().out == expected, checkpoint
    # --to hf: a directory transformers loads, computing what the adapter did.
    assert main(["merge", str(tmp_path / "adapter"), str(tmp_path / "hf"), "--to", "hf"]) == 0
    ids = token_ids(gen, base.config)
    torch.testing.assert_close(hf_model(tmp_path / "hf")(ids, use_cache=False).logits, model(ids), **F32)
    # An existing output, and another base model, are refused.
    assert main(["merge", str(tmp_path / "adapter"), str(tmp_path / "hf"), "--to", "hf"]) == 2
    assert "--overwrite" in capsys.readouterr().err
    save_pretrained(base_model(gen, vocab_size=256), tmp_path / "other")
    assert main(["merge", str(tmp_path / "adapter"), str(tmp_path / "out"), "--base", str(tmp_path / "other")]) == 2
    assert "was trained on another base model" in capsys.readouterr().err
    assert not (tmp_path / "out").exists()
