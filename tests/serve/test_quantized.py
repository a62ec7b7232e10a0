"""``griffin serve --quantize int8`` (issue 19): a float checkpoint quantised on loading, an int8 checkpoint served as
it is, greedy completions equal to the int8 model's own ``generate``, and the options refused by name."""

from __future__ import annotations

import argparse

import pytest
import torch

from griffin import generate
from griffin.interop import save_pretrained
from griffin.quantize import quantization_of, quantize_int8
from griffin.serve.options import ServeConfig, add_serve_arguments, config_from_args
from griffin.serve.server import build_server
from griffin.serve.text import clean
from tests.serve.conftest import start_server, tiny_model


def serve_config(*argv: str) -> ServeConfig:
    p = argparse.ArgumentParser()
    add_serve_arguments(p)
    return config_from_args(p.parse_args(list(argv)))


def served_model(*argv: str):
    """The model ``griffin serve ARGV`` serves (loaded by :func:`griffin.load_for_use`)."""
    return build_server(serve_config(*argv)).engine.model


def test_quantize_int8_serves_the_int8_model(gen, tmp_path):
    model = tiny_model(gen)
    save_pretrained(model, tmp_path / "float")
    server = build_server(serve_config(str(tmp_path / "float"), "--quantize", "int8", "--group-size", "8"))
    served = server.engine.model
    assert quantization_of(served) == {"method": "int8", "group_size": 8}
    expected = quantize_int8(model, 8)
    for (name, a), (_, b) in zip(served.state_dict().items(), expected.state_dict().items(), strict=True):
        assert torch.equal(a, b), name  # the same int8 values and scales as quantising in memory

    save_pretrained(expected, tmp_path / "int8")  # an int8 checkpoint needs no flag
    assert quantization_of(served_model(str(tmp_path / "int8"))) == {"method": "int8", "group_size": 8}

    running = start_server(served)
    try:
        prompts = [torch.randint(32, 127, (n,), generator=gen).tolist() for n in (3, 11, 25)]
        for p in prompts:
            r = running.client.completions.create(model="tiny", prompt=p, max_tokens=12, temperature=0)
            tokens = generate(expected, [p], 12, temperature=0)[0]
            assert r.choices[0].text == clean(bytes(tokens).decode("utf-8", "surrogateescape"))
    finally:
        running.stop()


def test_quantize_options_refused_by_name(gen, tmp_path):
    save_pretrained(tiny_model(gen), tmp_path / "float")
    save_pretrained(quantize_int8(tiny_model(gen)), tmp_path / "int8")
    ckpt = str(tmp_path / "float")
    with pytest.raises(ValueError, match="CPU kernel only, not on device 'meta'"):
        served_model(ckpt, "--quantize", "int8", "--device", "meta")
    with pytest.raises(ValueError, match="int8 weights, which decode with the CPU kernel only, not on device 'meta'"):
        served_model(str(tmp_path / "int8"), "--device", "meta")
    with pytest.raises(ValueError, match="group_size=12 is not supported"):
        served_model(ckpt, "--quantize", "int8", "--group-size", "12")
    with pytest.raises(ValueError, match="group_size=8 applies to quantize='int8' only"):
        served_model(ckpt, "--group-size", "8")
    with pytest.raises(ValueError, match="already quantised"):  # an int8 checkpoint is not quantised twice ...
        quantize_int8(served_model(str(tmp_path / "int8")))
    # ... but served as it is when --quantize int8 is given for it
    assert quantization_of(served_model(str(tmp_path / "int8"), "--quantize", "int8")) is not None
    with pytest.raises(SystemExit):
        serve_config(ckpt, "--quantize", "int4")


def test_one_row_steps_of_an_int8_batch_run_the_matvec_kernel(gen):
    """Where a batch of int8 rows runs PyTorch's int8 matmul, a lone row decodes through the matvec kernel (its
    one-row path), a second copy sharing the weights; the tokens are the int8 model's own."""
    from griffin.inference.cpu.linear import Int8PackLinear, MatvecLinear, int8pack_for
    from griffin.serve.engine import Engine
    from griffin.serve.sampling import SamplingParams
    from tests.serve.test_engine import BYTES

    model = quantize_int8(tiny_model(gen, width=64).to(torch.bfloat16))
    engine = Engine(model, BYTES, max_batch=32)
    if not any(isinstance(m, Int8PackLinear) for m in engine.step_model.modules()):
        assert not int8pack_for(32)  # this host's kernel takes 32 int8 rows itself: one model does both
        return
    assert engine.one_row_model is not engine.step_model
    assert not any(isinstance(m, Int8PackLinear) for m in engine.one_row_model.modules())
    assert any(isinstance(m, MatvecLinear) for m in engine.one_row_model.modules())
    engine.start()
    try:
        prompt = list(b"one row at a time")
        out = engine.generate(prompt, SamplingParams(max_tokens=8, temperature=0))
        assert out.choices[0].token_ids == generate(model, [prompt], 8, temperature=0)[0]
    finally:
        engine.stop()
