"""Several LoRA adapters served unmerged on one base (``griffin serve BASE --adapter name=DIR ...``, issue 37): rows of
one batch on different adapters each compute what their adapter merged into the base computes alone (prefill and
decode, logits and greedy tokens), base rows beside them are untouched, the request's ``model`` field picks the
adapter through the real server (an unknown one is a 404 and the server keeps serving), an adapter trained on another
base is refused at start-up, and the prefix cache does not hand one adapter's state to another."""

from __future__ import annotations

import argparse
import copy
import threading

import openai
import pytest
import torch

from griffin import CausalLM, generate
from griffin.inference import Decoder
from griffin.inference.generate import decode_model
from griffin.interop import save_pretrained
from griffin.interop.adapters import AdapterError, LoraSettings, base_fingerprint, resolve_targets, save_adapter
from griffin.quantize import quantization_of
from griffin.serve import adapters as serve_adapters
from griffin.serve.adapters import AdapterSet, load_adapters, merged_reference, multi_lora_swapped
from griffin.serve.engine import Engine
from griffin.serve.options import ServeConfig, add_serve_arguments, config_from_args, split_adapters
from griffin.serve.sampling import SamplingParams
from griffin.serve.server import build_server
from tests.serve.conftest import start_server, tiny_model
from tests.serve.test_server import byte_text

# (rank, targets): different ranks (the stacks pad them) and different layers (the others add nothing)
SPECS = {"alpha": (4, "all"), "beta": (2, "mlp"), "gamma": (3, "attention,recurrent")}
# Logits (of magnitude ~5) through the unmerged adapters against their float64 merged reference: in float64 the same
# sums rounded in another order (W x + B (A x) against (W + B A) x); in float32 the decode path's own rounding (up to
# 7e-5 seen over 20 seeds, after 4 steps; merging in float32 rounds the merged weights, up to 1.5e-4 off float64, so
# the reference is float64 for both). A row on the wrong adapter is off by more than 1e-3 (checked below).
F32 = {"rtol": 0.0, "atol": 2e-4}
F64 = {"rtol": 0.0, "atol": 1e-11}


def write_adapter(directory, model: CausalLM, gen: torch.Generator, r: int, targets: str, std: float = 0.3) -> None:
    """A trained-looking adapter for ``model`` (A and B both drawn: it changes what the model computes), with
    ``model``'s base fingerprint, as ``griffin finetune`` writes it."""
    pairs = {}
    for name in resolve_targets(model.config, targets):
        layer = model.get_submodule(name)
        pairs[name] = (torch.randn(r, layer.in_features, generator=gen) * std,
                       torch.randn(layer.out_features, r, generator=gen) * std)
    fingerprint = base_fingerprint({name: model.get_submodule(name).weight for name in pairs})
    save_adapter(directory, model.config, LoraSettings(r, 2.0 * r), pairs, fingerprint, "base")


def adapters_for(model: CausalLM, gen: torch.Generator, root) -> AdapterSet:
    for name, (r, targets) in SPECS.items():
        write_adapter(root / name, model, gen, r, targets)
    return load_adapters(model, {name: root / name for name in SPECS}, "tiny")


def references(model: CausalLM, adapters: AdapterSet) -> dict[str | None, CausalLM]:
    """Each adapter merged into a float64 copy of the base (the reference), and the base itself (None)."""
    model = copy.deepcopy(model).double()
    return {None: model, **{a.name: merged_reference(model, a) for a in adapters.adapters}}


@pytest.mark.parametrize(("preset", "dtype", "path"), [("griffin-tiny", torch.float32, "masked"),
                                                       ("griffin-tiny", torch.float32, "gather"),
                                                       ("mqa-tiny", torch.float32, "gather"),
                                                       ("hawk-tiny", torch.float64, "masked")])
def test_rows_on_different_adapters_equal_each_adapter_merged_alone(gen, tmp_path, monkeypatch, preset, dtype, path):
    """One prefill of a batch and decode steps of the decode copy (prepacked or matvec matmuls, fused blocks), rows
    on three adapters and the base, through either batched path (all adapters side by side, masked; or each row's
    pair gathered): each row's logits are those of its adapter merged, run alone."""
    if path == "gather":
        monkeypatch.setattr(serve_adapters, "MASKED_COLUMNS", 0)
    model = tiny_model(gen, preset).to(dtype)
    adapters = adapters_for(model, gen, tmp_path)
    refs = references(model, adapters)
    which = [0, -1, 1, 2, 0, -1]  # adapter index per row (-1: the base)
    names = [None if i < 0 else adapters.names[i] for i in which]
    swapped = multi_lora_swapped(model, adapters)
    step_model = decode_model(swapped, len(which))
    tol = F64 if dtype == torch.float64 else F32
    T = 9  # longer than the tiny presets' attention window (6)
    ids = torch.randint(0, 256, (len(which), T), generator=gen)
    cache = swapped.init_cache(len(which), 64)
    swapped.adapter_rows.set(which)
    assert swapped.adapter_rows.mode == path
    logits = swapped(ids, cache=cache)
    ref_caches = [refs[n].init_cache(1, 64) for n in names]
    changed = False
    for row, name in enumerate(names):
        want = refs[name](ids[row : row + 1], cache=ref_caches[row])
        torch.testing.assert_close(logits[row : row + 1].double(), want, **tol)
        changed |= name is not None and not torch.allclose(want, refs[None](ids[row : row + 1]), atol=1e-3)
    assert changed  # the adapters change the outputs
    decoder = Decoder(step_model, cache)
    tokens = logits[:, -1].argmax(-1)
    for _ in range(4):
        got = decoder(tokens)
        for row, name in enumerate(names):
            want = refs[name](tokens[row : row + 1, None], cache=ref_caches[row])[:, -1]
            torch.testing.assert_close(got[row : row + 1].double(), want, **tol)
        tokens = got.argmax(-1)
    # one adapter on every row, and the base on every row, take their own paths
    for rows in ([1] * len(which), [-1] * len(which)):
        swapped.adapter_rows.set(rows)
        want = refs[None if rows[0] < 0 else adapters.names[rows[0]]](ids)
        torch.testing.assert_close(swapped(ids).double(), want, **tol)


def test_an_engine_batch_mixing_adapters_gives_each_request_its_adapter_alone(gen, tmp_path):
    """Requests on three adapters and the base, queued together so that they decode in one batch: each gets the
    greedy tokens of ``generate`` on its adapter merged into the base (float64: no near-tie can flip a token)."""
    model = tiny_model(gen).double()
    adapters = adapters_for(model, gen, tmp_path)
    refs = references(model, adapters)
    engine = Engine(model, None, max_batch=8, prefill_chunk=64, adapters=adapters)
    seen: list[list[int]] = []
    set_rows = engine._set_adapters
    engine._set_adapters = lambda indices: (seen.append(list(indices)), set_rows(indices))
    picks = [None, "alpha", "beta", "gamma", "alpha", None, "gamma"]
    prompts = [torch.randint(0, 256, (int(torch.randint(2, 12, (1,), generator=gen)),), generator=gen).tolist()
               for _ in picks]
    params = SamplingParams(max_tokens=10, temperature=0)
    handles = [engine.submit(p, params, adapter=a) for p, a in zip(prompts, picks, strict=True)]  # before start
    engine.start()
    try:
        for handle, prompt, pick in zip(handles, prompts, picks, strict=True):
            tokens = [t for update in handle for c in update.choices for t in c.token_ids]
            assert tokens == generate(refs[pick], [prompt], 10, temperature=0)[0], pick
        assert any(len(set(rows)) == 4 for rows in seen)  # a decode step held rows of all four models
        with pytest.raises(ValueError, match="no LoRA adapter 'delta' is served"):
            engine.submit(prompts[0], params, adapter="delta")
    finally:
        engine.stop()


def test_the_prefix_cache_is_keyed_per_adapter(gen, tmp_path):
    """The same prompt on another adapter (or the base) starts cold and gets its own tokens; on the same adapter it
    hits."""
    model = tiny_model(gen).double()
    adapters = adapters_for(model, gen, tmp_path)
    refs = references(model, adapters)
    engine = Engine(model, None, max_batch=4, prefill_chunk=16, adapters=adapters).start()
    try:
        prompt = torch.randint(0, 256, (40,), generator=gen).tolist()
        params = SamplingParams(max_tokens=8, temperature=0)
        outs = {}
        for pick in ("alpha", "beta", None):
            out = engine.generate(prompt, params, adapter=pick)
            assert out.prefix_hit == 0, pick  # another adapter's state of the same prompt is not used
            outs[pick] = out.choices[0].token_ids
            assert outs[pick] == generate(refs[pick], [prompt], 8, temperature=0)[0], pick
        assert len(set(map(tuple, outs.values()))) == 3
        again = engine.generate(prompt, params, adapter="beta")
        assert again.prefix_hit > 0 and again.choices[0].token_ids == outs["beta"]
    finally:
        engine.stop()


def test_the_model_field_picks_the_adapter_through_the_server(gen, tmp_path):
    """The real server and ``openai`` client: completions and chat on an adapter equal ``generate`` on it merged;
    /v1/models lists the base and its adapters; an unknown model is a 404 naming the served ones, and the server
    keeps serving."""
    model = tiny_model(gen).double()
    adapters = adapters_for(model, gen, tmp_path)
    refs = references(model, adapters)
    running = start_server(model, adapters=adapters)
    c = running.client
    try:
        prompt = "def griffin("
        ids = list(prompt.encode())
        results: dict[str | None, str] = {}

        def ask(pick: str | None) -> None:
            r = c.completions.create(model=pick or "tiny", prompt=prompt, max_tokens=10, temperature=0)
            assert r.model == (pick or "tiny")
            results[pick] = r.choices[0].text

        threads = [threading.Thread(target=ask, args=(p,)) for p in (None, "alpha", "beta", "gamma")]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        for pick, text in results.items():
            assert text == byte_text(generate(refs[pick], [ids], 10, temperature=0)[0]), pick
        chat = c.chat.completions.create(model="gamma", messages=[{"role": "user", "content": "Hi"}], max_tokens=6,
                                         temperature=0)
        chat_ids = list(b"<|user|>\nHi<|end|>\n<|assistant|>\n")
        text = byte_text(generate(refs["gamma"], [chat_ids], 6, temperature=0)[0])
        assert chat.model == "gamma" and chat.choices[0].message.content == text.split("<|end|>")[0]

        listed = {m.id: m for m in c.models.list().data}
        assert set(listed) == {"tiny", "alpha", "beta", "gamma"}
        assert listed["alpha"].parent == "tiny" and listed["tiny"].parent is None

        with pytest.raises(openai.NotFoundError) as err:
            c.completions.create(model="delta", prompt=prompt, max_tokens=4)
        body = err.value.body
        assert body["code"] == "model_not_found" and body["param"] == "model"
        assert all(f"`{m}`" in body["message"] for m in ("delta", "tiny", "alpha", "beta", "gamma"))
        status, _, _ = running.request("POST", "/v1/chat/completions",
                                       {"model": "delta", "messages": [{"role": "user", "content": "x"}]})
        assert status == 404
        r = c.completions.create(model="alpha", prompt=prompt, max_tokens=10, temperature=0)  # still serving
        assert r.choices[0].text == results["alpha"]
    finally:
        running.stop()


def serve_config(*argv: str) -> ServeConfig:
    p = argparse.ArgumentParser()
    add_serve_arguments(p)
    return config_from_args(p.parse_args(list(argv)))


def test_griffin_serve_loads_named_adapters_and_refuses_one_of_another_base(gen, tmp_path):
    """``--adapter NAME=DIR`` serves unmerged (each with the chat template stored beside it, else the base's),
    ``--adapter DIR`` still merges; an adapter trained on another base model, a bad name or a mix of both kinds is
    refused at start-up, by name. With ``--quantize int8`` the adapters are checked on the float weights, then the
    base is quantised."""
    model, other = tiny_model(gen), tiny_model(gen)
    save_pretrained(model, tmp_path / "base")
    write_adapter(tmp_path / "ours", model, gen, 2, "all")
    write_adapter(tmp_path / "theirs", other, gen, 2, "all")
    (tmp_path / "ours" / "chat_template.jinja").write_text("{% for m in messages %}[{{ m.content }}]{% endfor %}")

    base, ours, theirs = (str(tmp_path / n) for n in ("base", "ours", "theirs"))
    cfg = serve_config(base, "--adapter", f"mine={ours}", "--adapter", f"plain={ours}x")
    assert cfg.adapter is None and cfg.adapters == {"mine": ours, "plain": ours + "x"}
    assert serve_config(base, "--adapter", ours).adapter == ours  # one directory: merged, as before
    with pytest.raises(ValueError, match="merges one adapter"):
        split_adapters([ours, theirs])
    with pytest.raises(ValueError, match="do not go together"):
        split_adapters([ours, f"x={theirs}"])

    server = build_server(serve_config(base, "--adapter", f"mine={ours}", "--adapter", f"again={ours}",
                                       "--served-model-name", "tiny"))
    assert server.engine.adapters.names == ["mine", "again"]
    assert server.adapter_templates["mine"]([{"role": "user", "content": "hi"}])[0] == list(b"[hi]")
    assert server.adapter_templates["again"] is not server.chat_template  # (the same directory: its template)
    out = server.engine.model  # the engine runs the swapped copy of the base
    assert out is not None and server.engine.adapter_rows is not None

    with pytest.raises(AdapterError, match=r"adapter 'bad': the adapter .*theirs was trained on another base model"):
        build_server(serve_config(base, "--adapter", f"mine={ours}", "--adapter", f"bad={theirs}"))
    with pytest.raises(ValueError, match="is the base model's served name"):
        build_server(serve_config(base, "--adapter", f"base={ours}"))
    with pytest.raises(ValueError, match="adapter name"):
        load_adapters(model, {"no spaces": ours})

    server = build_server(serve_config(base, "--quantize", "int8", "--adapter", f"mine={ours}"))
    assert quantization_of(server.engine.model) is not None
    engine = server.engine.start()
    try:
        out = engine.generate(list(b"abc"), SamplingParams(max_tokens=4, temperature=0), adapter="mine")
        assert len(out.choices[0].token_ids) == 4
    finally:
        engine.stop()
