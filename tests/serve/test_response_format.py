"""``response_format`` (JSON mode and JSON-schema mode through llguidance): random tiny models write garbage, which is
what the token mask must constrain. 50 seeded sampled requests validate against a schema; json_object output parses;
bad formats and schemas get a 400 naming them while the server keeps serving; the mask is per row (a free row in a
batch with a grammar row gives what it gives alone); per-choice grammar state; the byte-level (no EOS), HF BPE and
SentencePiece tokenizers' token bytes; the sampler's mask on greedy and seeded rows."""

from __future__ import annotations

import json
import threading
from concurrent.futures import ThreadPoolExecutor

import jsonschema
import openai
import pytest
import torch

from griffin import CausalLM, ModelConfig, generate
from griffin.data.tokenizer import load_tokenizer, train_bpe
from griffin.serve import grammar as grammar_module
from griffin.serve.engine import Engine
from griffin.serve.grammar import GrammarCompiler, GrammarError, ResponseFormat, parse_response_format
from griffin.serve.sampling import SamplingParams, TokenMask, choice_generator, sample_rows, sample_rows_reference
from tests.conftest import perturb_, seed_torch
from tests.serve.conftest import tiny_model

pytest.importorskip("llguidance")

BYTES = load_tokenizer("bytes")
SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 5},
        "age": {"type": "integer", "minimum": 0, "maximum": 150},
        "color": {"enum": ["red", "tan", "blue"]},
        "tags": {"type": "array", "items": {"type": "string", "maxLength": 4}, "maxItems": 2},
    },
    "required": ["name", "age", "color", "tags"],
    "additionalProperties": False,
}
SCHEMA_FORMAT = {"type": "json_schema", "json_schema": {"name": "person", "schema": SCHEMA, "strict": True}}


def schema_params(**kw) -> SamplingParams:
    return SamplingParams(response_format=parse_response_format(SCHEMA_FORMAT), **kw)


def test_fifty_seeded_sampled_requests_validate_against_the_schema(server):
    """Temperature 1, 50 seeds, 8 rows at a time: every output is JSON that validates, and ends with ``stop``."""
    def ask(seed: int):
        return server.client.chat.completions.create(
            model="tiny", messages=[{"role": "user", "content": f"Describe person {seed} as JSON."}],
            temperature=1.0, seed=seed, max_tokens=400, response_format=SCHEMA_FORMAT)

    with ThreadPoolExecutor(8) as pool:
        replies = list(pool.map(ask, range(50)))
    for seed, r in enumerate(replies):
        choice = r.choices[0]
        assert choice.finish_reason == "stop", (seed, choice.message.content)
        jsonschema.validate(json.loads(choice.message.content), SCHEMA)
    assert len({r.choices[0].message.content for r in replies}) > 25  # the seeds sample different objects
    # the same seed samples the same object again, whatever batch it shares
    assert ask(7).choices[0].message.content == replies[7].choices[0].message.content


def test_json_object_mode_streaming_n_and_completions(server):
    """json_object: every choice that ends is a JSON object, and one cut by max_tokens (a random model may wander in
    a string) is a prefix the grammar accepts; n > 1 choices each have their own grammar state; streamed deltas add up
    to valid JSON; the completions endpoint takes response_format too."""
    c = server.client

    def ask(k: int):
        return c.chat.completions.create(model="tiny", messages=[{"role": "user", "content": f"{k * 7919} objects"}],
                                         n=4, seed=100 * k, temperature=1.0, max_tokens=120,
                                         response_format={"type": "json_object"})

    with ThreadPoolExecutor(2) as pool:
        replies = list(pool.map(ask, range(2)))
    compiler = GrammarCompiler(BYTES, 256)
    for r in replies:
        for choice in r.choices:
            text = choice.message.content
            assert text.startswith("{")
            if choice.finish_reason == "stop":
                assert isinstance(json.loads(text), dict)
            else:
                assert choice.finish_reason == "length"
                row = compiler.row(parse_response_format({"type": "json_object"}))
                assert row.matcher.consume_tokens(list(text.encode("utf-8", "surrogateescape"))), text
    stream = c.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "Stream it."}], seed=3,
                                       max_tokens=400, response_format=SCHEMA_FORMAT, stream=True)
    chunks = list(stream)
    jsonschema.validate(json.loads("".join(ch.choices[0].delta.content or "" for ch in chunks)), SCHEMA)
    assert chunks[-1].choices[0].finish_reason == "stop"
    r = c.completions.create(model="tiny", prompt="JSON: ", n=3, seed=5, max_tokens=400,
                             extra_body={"response_format": SCHEMA_FORMAT})
    for choice in r.choices:
        jsonschema.validate(json.loads(choice.text), SCHEMA)
    # max_tokens mid-JSON: cut, with reason length
    r = c.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "x"}], seed=1, max_tokens=5,
                                  response_format=SCHEMA_FORMAT)
    assert r.choices[0].finish_reason == "length" and r.choices[0].message.content == '{"nam'
    # type text: free text, as without response_format
    free = dict(model="tiny", messages=[{"role": "user", "content": "x"}], temperature=0, max_tokens=8)
    assert c.chat.completions.create(**free, response_format={"type": "text"}).choices[0].message.content == \
        c.chat.completions.create(**free).choices[0].message.content


def test_bad_formats_and_schemas_get_a_400_naming_them_and_the_server_keeps_serving(server):
    bad = [
        ({"type": "xml"}, "response_format.type='xml'"),
        ({"type": "json_schema"}, "response_format.json_schema must be an object"),
        ({"type": "json_schema", "json_schema": {"name": "s", "schema": [1]}}, "must be a JSON schema"),
        ({"type": "json_schema", "json_schema": {"name": "s", "schema": {"type": "nonsense"}}},
         "Invalid type: nonsense"),
        ({"type": "json_schema", "json_schema": {"name": "refs", "schema": {
            "type": "object", "properties": {"a": {"$ref": "#/definitions/missing"}}}}}, "missing"),
        ({"type": "json_schema", "json_schema": {"name": "pat", "schema": {"type": "string", "pattern": "(("}}},
         "unclosed group"),
        ("json", "response_format"),
    ]
    for fmt, needle in bad:
        for path, body in (("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}]}),
                           ("/v1/completions", {"prompt": "hi"})):
            status, _, text = server.request("POST", path, {"model": "tiny", "max_tokens": 5, "response_format": fmt,
                                                            **body})
            assert status == 400, (fmt, text)
            error = json.loads(text)["error"]
            assert needle in error["message"] and error["param"] == "response_format", (fmt, error)
    with pytest.raises(openai.BadRequestError, match="nonsense"):
        server.client.chat.completions.create(
            model="tiny", messages=[{"role": "user", "content": "hi"}], max_tokens=5,
            response_format={"type": "json_schema", "json_schema": {"name": "n", "schema": {"type": "nonsense"}}})
    r = server.client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "hi"}], seed=2,
                                              max_tokens=400, response_format=SCHEMA_FORMAT)
    jsonschema.validate(json.loads(r.choices[0].message.content), SCHEMA)


def test_without_llguidance_a_json_request_gets_a_501_naming_the_extra(server, monkeypatch):
    def missing():
        raise GrammarError(f"response_format needs the llguidance library: {grammar_module.INSTALL_HINT}", 501)

    monkeypatch.setattr(grammar_module, "_llguidance", missing)
    status, _, text = server.request("POST", "/v1/chat/completions", {
        "model": "tiny", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 5,
        "response_format": {"type": "json_schema", "json_schema": {"name": "new", "schema": {"type": "array"}}}})
    assert status == 501 and "griffin[serve]" in json.loads(text)["error"]["message"]
    r = server.client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "hi"}],
                                              max_tokens=5)
    assert r.choices[0].finish_reason == "length"


def test_the_mask_is_per_row(gen):
    """A greedy free row decoding beside grammar rows gives exactly what it gives alone, and the grammar row gives
    what it gives alone; rows finish and free their slots independently."""
    model = tiny_model(gen)
    engine = Engine(model, BYTES, max_batch=4, prefill_chunk=64)
    engine.warmup()
    prompt = list(b"Tell me about a person: ")
    free, constrained = SamplingParams(max_tokens=40, temperature=0), schema_params(max_tokens=300, temperature=0)
    sampled = schema_params(max_tokens=300, seed=int(torch.randint(0, 2**31, (1,), generator=gen)))
    handles = [engine.submit(prompt, p) for p in (free, constrained, sampled)]  # queued: they join one batch
    results = [[], [], []]

    def read(i: int) -> None:
        for update in handles[i]:
            for c in update.choices:
                results[i] += c.token_ids

    threads = [threading.Thread(target=read, args=(i,)) for i in range(3)]
    for t in threads:
        t.start()
    engine.start()
    try:
        for t in threads:
            t.join(timeout=120)
        assert results[0] == generate(model, [prompt], 40, temperature=0)[0]
        alone = engine.generate(prompt, constrained).choices[0]
        assert results[1] == alone.token_ids and alone.finish_reason == "stop"
        jsonschema.validate(json.loads(bytes(results[1])), SCHEMA)
        jsonschema.validate(json.loads(bytes(results[2])), SCHEMA)
        assert not engine.rows
    finally:
        engine.stop()


def test_sample_rows_applies_the_mask_to_greedy_and_seeded_rows_and_no_other(gen):
    logits = torch.randn(5, 40, generator=gen) * 3
    seed = int(torch.randint(0, 2**31, (1,), generator=gen))
    params = [SamplingParams(temperature=0), SamplingParams(temperature=0.8, seed=seed),
              SamplingParams(temperature=0), SamplingParams(temperature=1.2, top_k=3, top_p=0.9, seed=seed + 1),
              SamplingParams(temperature=0)]
    allowed = torch.rand(3, 40, generator=gen) < 0.2
    allowed[:, 7] = True
    mask = TokenMask([0, 1, 3], allowed)
    before = logits.clone()
    fast = sample_rows(logits, params, [choice_generator(p, 0) for p in params], mask=mask)
    ref = sample_rows_reference(logits, params, [choice_generator(p, 0) for p in params], mask=mask)
    assert torch.equal(logits, before)  # the caller's logits (log-probabilities) are the model's
    assert fast.tolist() == ref.tolist()
    for j, row in enumerate(mask.rows):
        assert allowed[j, fast[row]]
    assert fast[0] == logits[0].masked_fill(~allowed[0], -torch.inf).argmax()
    assert fast[2] == logits[2].argmax() and fast[4] == logits[4].argmax()  # unmasked rows untouched


def test_parse_response_format():
    assert parse_response_format(None) is None and parse_response_format({"type": "text"}) is None
    assert parse_response_format({"type": "json_object"}) == ResponseFormat("json_object", '{"type": "object"}')
    fmt = parse_response_format(SCHEMA_FORMAT)
    assert fmt.kind == "json_schema" and fmt.name == "person" and json.loads(fmt.schema) == SCHEMA
    assert list(json.loads(fmt.schema)["properties"]) == ["name", "age", "color", "tags"]  # order kept
    hash(SamplingParams(response_format=fmt))  # hashable: SamplingParams stays a frozen value
    for bad in ({"type": None}, "json_object", {"type": "json_schema", "json_schema": {"schema": {}, "name": 3}}):
        with pytest.raises(GrammarError):
            parse_response_format(bad)


def test_compiled_grammars_are_cached_and_bounded():
    compiler = GrammarCompiler(BYTES, 256, cache_size=2)
    formats = [parse_response_format({"type": "json_schema", "json_schema": {"name": str(i), "schema": {
        "type": "object", "properties": {f"k{i}": {"type": "integer"}}}}}) for i in range(3)]
    for fmt in formats + formats[2:]:
        compiler.compile(fmt)
    assert compiler.compiled == 3 and len(compiler._cache) == 2
    a, b = compiler.row(formats[2]), compiler.row(formats[2])
    assert a.matcher is not b.matcher and not a.advance(ord("{"))
    allowed = compiler.mask([(0, a), (1, b)], 256, "cpu")
    assert allowed[0].nonzero().flatten().tolist() == [ord('"'), ord("}")]  # after "{": a key or the end
    assert allowed[1].nonzero().flatten().tolist() == [ord("{")]


def test_bpe_tokenizer_with_eos(gen, tmp_path):
    """An HF byte-level BPE tokenizer (llguidance reads its tokenizer.json): multi-byte tokens are allowed where
    their bytes fit, the row may end with EOS, and the output validates."""
    corpus = tmp_path / "corpus.txt"
    corpus.write_text('{"name": "ada", "age": 36, "color": "blue", "tags": ["math", "code"]}\n' * 40
                      + "the griffin and the hawk fly over the lake\n" * 40)
    tok = load_tokenizer(train_bpe([corpus], tmp_path / "tokenizer.json", 320))
    assert tok.eos_id is not None
    seed_torch(gen)
    model = CausalLM(ModelConfig.from_preset("hawk-tiny", vocab_size=320)).eval()
    perturb_(model, gen, 0.5)
    engine = Engine(model, tok, max_batch=4, prefill_chunk=32).start()
    try:
        prompt = tok.encode("the person: ")
        out = engine.generate(prompt, schema_params(max_tokens=300, n=4, seed=9))
        for c in out.choices:
            assert c.finish_reason == "stop", c.text
            jsonschema.validate(json.loads(c.text), SCHEMA)
        assert any(len(tok.decode([t]).encode()) > 1 for c in out.choices for t in c.token_ids)
    finally:
        engine.stop()
    compiler = GrammarCompiler(tok, 320)
    row = compiler.row(parse_response_format({"type": "json_object"}))
    for t in tok.encode('{"name": "ada"}'):
        assert compiler.mask([(0, row)], 320, "cpu")[0, t]
        done = row.advance(t)
    assert done and row.accepting  # nothing but EOS after the closing brace: the row ends at once


def test_sentencepiece_token_bytes(tmp_path):
    """SentencePiece pieces as llguidance sees them: ``▁`` is a space, ``<0x..>`` pieces are their byte."""
    spm = pytest.importorskip("sentencepiece")
    corpus = tmp_path / "corpus.txt"
    corpus.write_text('{"name": "ada", "age": 36}\nthe griffin and the hawk\n' * 50)
    spm.SentencePieceTrainer.train(input=str(corpus), model_prefix=str(tmp_path / "sp"), vocab_size=300,
                                   hard_vocab_limit=False, byte_fallback=True, character_coverage=1.0, minloglevel=2)
    tok = load_tokenizer(tmp_path / "sp.model")
    table = grammar_module._TokenBytes(tok, tok.vocab_size)
    byte_a = tok.sp.piece_to_id("<0x41>")
    assert table.tokens[byte_a] == b"A" and table.eos_token_id == tok.eos_id
    spaced = next(i for i in range(tok.vocab_size) if tok.sp.id_to_piece(i).startswith("\u2581")
                  and len(tok.sp.id_to_piece(i)) > 1)
    assert table.tokens[spaced] == tok.sp.id_to_piece(spaced).replace("\u2581", " ").encode()
    compiler = GrammarCompiler(tok, tok.vocab_size)
    row = compiler.row(parse_response_format({"type": "json_object"}))
    ids = tok.encode('{"name": "ada"}')
    ids = ids[1:] if tok.sp.id_to_piece(ids[0]) == "\u2581" else ids  # the dummy prefix of a text's start
    for t in ids:
        assert compiler.mask([(0, row)], tok.vocab_size, "cpu")[0, t], tok.sp.id_to_piece(t)
        done = row.advance(t)
    assert done
