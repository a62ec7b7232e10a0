"""The HTTP API with the real ``openai`` client against a server on 127.0.0.1: completions and chat, streamed and
not, n > 1, stop sequences, seeds, logprobs and echo, concurrent greedy requests equal to ``griffin.generate``, a
prefix-cache hit equal to a cold request; bad requests answered with OpenAI error bodies while the server keeps
serving; disconnects, back-pressure, metrics, and ``griffin serve`` itself."""

from __future__ import annotations

import http.client
import json
import os
import signal
import subprocess
import sys
import threading
import time

import openai
import pytest
import torch

from griffin import generate
from griffin.data.chat import ChatTemplate
from griffin.interop import save_pretrained
from griffin.serve.text import clean
from tests.serve.conftest import free_port, start_server, tiny_model


def byte_text(tokens: list[int]) -> str:
    return clean(bytes(tokens).decode("utf-8", "surrogateescape"))


def test_completions_and_chat_streamed_and_not(server):
    c = server.client
    prompt = "The griffin "
    ids = list(prompt.encode())
    expected = generate(server.model, [ids], 12, temperature=0)[0]
    r = c.completions.create(model="tiny", prompt=prompt, max_tokens=12, temperature=0)
    assert r.choices[0].text == byte_text(expected) and r.choices[0].finish_reason == "length"
    assert (r.usage.prompt_tokens, r.usage.completion_tokens) == (len(ids), 12)
    chunks = list(c.completions.create(model="tiny", prompt=prompt, max_tokens=12, temperature=0, stream=True,
                                       stream_options={"include_usage": True}))
    assert "".join(ch.choices[0].text for ch in chunks if ch.choices) == r.choices[0].text
    assert [ch.choices[0].finish_reason for ch in chunks if ch.choices][-1] == "length"
    assert chunks[-1].usage.completion_tokens == 12
    # token prompts, several at once
    r = c.completions.create(model="tiny", prompt=[ids, ids[:3]], max_tokens=5, temperature=0)
    assert [ch.index for ch in r.choices] == [0, 1]
    assert r.choices[1].text == byte_text(generate(server.model, [ids[:3]], 5, temperature=0)[0])

    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hello?"}]
    chat_ids, _ = ChatTemplate(server.engine.tokenizer)(messages)
    assert bytes(chat_ids).decode() == "<|system|>\nBe brief.<|end|>\n<|user|>\nHello?<|end|>\n<|assistant|>\n"
    expected = generate(server.model, [chat_ids], 10, temperature=0)[0]
    r = c.chat.completions.create(model="tiny", messages=messages, max_tokens=10, temperature=0)
    text = byte_text(expected)
    cut = text.find("<|end|>")
    assert r.choices[0].message.content == (text if cut < 0 else text[:cut])
    assert r.choices[0].message.role == "assistant" and r.usage.prompt_tokens == len(chat_ids)
    deltas = list(c.chat.completions.create(model="tiny", messages=messages, max_tokens=10, temperature=0,
                                            stream=True))
    assert deltas[0].choices[0].delta.role == "assistant"
    assert "".join(d.choices[0].delta.content or "" for d in deltas) == r.choices[0].message.content
    assert deltas[-1].choices[0].finish_reason == r.choices[0].finish_reason


def test_n_seeds_stop_sequences_logprobs_and_echo(server, gen):
    c = server.client
    seed = int(torch.randint(0, 2**31, (1,), generator=gen))
    kw = dict(model="tiny", prompt="abc", max_tokens=16, temperature=1.0, seed=seed)
    a, b = c.completions.create(n=3, **kw), c.completions.create(n=3, **kw)
    texts = [ch.text for ch in a.choices]
    assert texts == [ch.text for ch in b.choices] and len(set(texts)) > 1  # reproducible, and n distinct samples
    # choice 0 samples as griffin.generate does with the same seed
    assert texts[0] == byte_text(generate(server.model, [list(b"abc")], 16, temperature=1.0, seed=seed)[0])
    streamed = {}
    for ch in c.completions.create(n=3, stream=True, **kw):
        streamed[ch.choices[0].index] = streamed.get(ch.choices[0].index, "") + ch.choices[0].text
    assert [streamed[i] for i in range(3)] == texts

    # stop sequences: the text is cut before the first one, finish reason "stop"
    full = c.completions.create(model="tiny", prompt="xyz", max_tokens=30, temperature=0).choices[0].text
    stop = full[7:9]
    r = c.completions.create(model="tiny", prompt="xyz", max_tokens=30, temperature=0, stop=[stop, "\x00never"])
    assert r.choices[0].text == full[: full.find(stop)] and r.choices[0].finish_reason == "stop"
    pieces = [ch.choices[0].text for ch in c.completions.create(model="tiny", prompt="xyz", max_tokens=30,
                                                                 temperature=0, stop=stop, stream=True)]
    assert "".join(pieces) == r.choices[0].text

    # echo + logprobs, as lm-evaluation-harness' local-completions scores: prompt tokens' log-probabilities
    prompt = list(b"hello griffin")
    r = c.completions.create(model="tiny", prompt=[prompt], max_tokens=1, temperature=0, logprobs=1, echo=True)
    lp = r.choices[0].logprobs
    with torch.no_grad():
        logp = torch.log_softmax(server.model(torch.tensor([prompt])).float(), -1)[0]
    assert r.choices[0].text.startswith("hello griffin")
    assert lp.token_logprobs[0] is None and len(lp.token_logprobs) == len(prompt) + 1
    ref = [float(logp[i, prompt[i + 1]]) for i in range(len(prompt) - 1)]
    torch.testing.assert_close(torch.tensor(lp.token_logprobs[1 : len(prompt)]), torch.tensor(ref), atol=1e-4,
                               rtol=1e-4)
    assert lp.token_logprobs[-1] == max(lp.top_logprobs[-1].values())  # greedy: the token is its top-1
    # chat logprobs
    r = c.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "hi"}], max_tokens=4,
                                  temperature=0, logprobs=True, top_logprobs=2)
    content = r.choices[0].logprobs.content
    assert all(len(t.top_logprobs) == 2 and t.top_logprobs[0].logprob == t.logprob for t in content)


def test_concurrent_greedy_requests_equal_generate_and_a_prefix_hit_equals_a_cold_request(server, gen):
    """Eight requests of different prompt lengths, sent at once (one running batch), each equal to
    ``griffin.generate`` of its prompt alone; a chat's next turn from the prefix cache equals a cold server's."""
    c = server.client
    prompts = [torch.randint(32, 127, (int(n),), generator=gen).tolist()
               for n in torch.randint(1, 60, (8,), generator=gen)]
    results = [None] * len(prompts)

    def go(i: int) -> None:
        results[i] = c.completions.create(model="tiny", prompt=prompts[i], max_tokens=10 + i, temperature=0)

    threads = [threading.Thread(target=go, args=(i,)) for i in range(len(prompts))]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert sum(server.engine.metrics.histograms["griffin_decode_batch_size"].counts[1:]) > 0
    for i, p in enumerate(prompts):
        assert results[i].choices[0].text == byte_text(generate(server.model, [p], 10 + i, temperature=0)[0])

    history = [{"role": "system", "content": "You are a griffin." * 4}, {"role": "user", "content": "Fly?"}]
    first = c.chat.completions.create(model="tiny", messages=history, max_tokens=8, temperature=0)
    history += [{"role": "assistant", "content": first.choices[0].message.content},
                {"role": "user", "content": "And now?"}]
    hit = c.chat.completions.create(model="tiny", messages=history, max_tokens=12, temperature=0)
    assert hit.usage.prompt_tokens_details.cached_tokens > 0
    cold = start_server(server.model, prefix_cache_bytes=0)
    try:
        miss = cold.client.chat.completions.create(model="tiny", messages=history, max_tokens=12, temperature=0)
    finally:
        cold.stop()
    assert miss.usage.prompt_tokens_details.cached_tokens == 0
    assert hit.choices[0].message.content == miss.choices[0].message.content


BAD_REQUESTS = [
    (b"{not json", 400, None),
    (b"[1, 2]", 400, None),
    ({"model": "gpt-5", "prompt": "a"}, 404, "model"),
    ({"model": "tiny", "prompt": "a", "max_tokens": -1}, 400, "max_tokens"),
    ({"model": "tiny", "prompt": "a", "max_tokens": 10**9}, 400, "max_tokens"),
    (b'{"model": "tiny", "prompt": "a", "temperature": NaN}', 400, "temperature"),
    ({"model": "tiny", "prompt": [5, 300]}, 400, "prompt"),
    ({"model": "tiny", "prompt": [-1]}, 400, "prompt"),
    ({"model": "tiny", "prompt": ""}, 400, "prompt"),
    ({"model": "tiny", "prompt": []}, 400, "prompt"),
    ({"model": "tiny", "prompt": "a", "top_p": 0}, 400, "top_p"),
    ({"model": "tiny", "prompt": "a", "n": 0}, 400, "n"),
    ({"model": "tiny", "prompt": "a", "stop": [""]}, 400, "stop"),
    ({"model": "tiny", "prompt": "a", "presence_penalty": 1.0}, 400, "presence_penalty"),
    ({"model": "tiny"}, 400, "prompt"),
    ({"model": "tiny", "messages": []}, 400, "messages"),
    ({"model": "tiny", "messages": [{"content": "no role"}]}, 400, "messages"),
]


def test_bad_requests_get_openai_errors_and_the_server_keeps_serving(server):
    for body, status, param in BAD_REQUESTS:
        path = "/v1/chat/completions" if isinstance(body, dict) and "messages" in body else "/v1/completions"
        got, _, text = server.request("POST", path, body)
        error = json.loads(text)["error"]
        assert got == status, (body, text)
        assert error["message"] and error["type"] and error["param"] == param, (body, text)
    # the client's own exception types
    with pytest.raises(openai.NotFoundError):
        server.client.completions.create(model="other", prompt="a")
    with pytest.raises(openai.BadRequestError, match="outside the vocabulary"):
        server.client.completions.create(model="tiny", prompt=[1, 999])
    assert server.request("GET", "/nowhere")[0] == 404
    r = server.client.completions.create(model="tiny", prompt="still here", max_tokens=3)
    assert r.choices[0].finish_reason == "length" and server.engine.running == 0


def test_an_mqa_prompt_too_long_for_its_kv_cache_is_refused(gen):
    running = start_server(tiny_model(gen, "mqa-tiny"), max_length=32)
    try:
        with pytest.raises(openai.BadRequestError, match="KV cache"):
            running.client.completions.create(model="tiny", prompt=[1] * 30, max_tokens=8)
        r = running.client.completions.create(model="tiny", prompt=[1] * 20, max_tokens=12, temperature=0)
        assert r.choices[0].text == byte_text(generate(running.model, [[1] * 20], 12, temperature=0)[0])
    finally:
        running.stop()


def test_a_client_that_disconnects_mid_stream_frees_its_row(server):
    conn = http.client.HTTPConnection("127.0.0.1", server.port, timeout=30)
    body = {"model": "tiny", "prompt": "go on", "max_tokens": 4000, "temperature": 0, "stream": True}
    conn.request("POST", "/v1/completions", body=json.dumps(body), headers={"Content-Type": "application/json"})
    response = response_stream = conn.getresponse()
    assert response.status == 200 and response_stream.readline().startswith(b"data: ")
    assert server.engine.running == 1
    conn.sock.close()  # the client goes away mid-stream
    conn.close()
    deadline = time.monotonic() + 20
    while server.engine.running and time.monotonic() < deadline:
        time.sleep(0.02)
    assert server.engine.running == 0
    # a non-streaming request whose client leaves is cancelled too
    conn = http.client.HTTPConnection("127.0.0.1", server.port, timeout=30)
    body["stream"] = False
    conn.request("POST", "/v1/completions", body=json.dumps(body), headers={"Content-Type": "application/json"})
    while server.engine.running == 0 and time.monotonic() < deadline:
        time.sleep(0.01)
    conn.sock.close()
    conn.close()
    while server.engine.running and time.monotonic() < deadline:
        time.sleep(0.02)
    assert server.engine.running == 0
    assert server.client.completions.create(model="tiny", prompt="next", max_tokens=2).choices[0].text is not None


def test_a_full_queue_answers_429_with_retry_after(gen):
    # requests that cannot end while the test runs (a loaded host decoded 4,000 tokens before the queue was seen full)
    running = start_server(tiny_model(gen), max_batch=1, max_queue=1, max_tokens_limit=10**7)
    try:
        long = {"model": "tiny", "prompt": "a", "max_tokens": 10**7, "temperature": 0, "timeout": 120}
        threads = []
        # one at a time: a second request sent while the first still waits for the row would itself get the 429
        for wanted in ((1, 0), (1, 1)):
            threads.append(threading.Thread(target=running.request, args=("POST", "/v1/completions", long)))
            threads[-1].start()
            deadline = time.monotonic() + 60
            while (running.engine.running, running.engine.queue_length) != wanted:
                assert time.monotonic() < deadline, f"the long requests did not reach (running, queued) = {wanted}"
                time.sleep(0.01)
        status, headers, text = running.request("POST", "/v1/completions", {"model": "tiny", "prompt": "b"})
        assert status == 429 and int(headers["retry-after"]) >= 1
        assert json.loads(text)["error"]["type"] == "rate_limit_error"
        assert running.metric("griffin_requests_rejected_total") == 1
        assert running.metric("griffin_queue_length") == 1 and running.metric("griffin_running_batch_size") == 1
    finally:
        running.stop()  # shutdown ends the long requests
    for t in threads:
        t.join(timeout=30)


def test_models_health_metrics_and_tokenizer_endpoints(server):
    assert [m.id for m in server.client.models.list().data] == ["tiny"]
    assert json.loads(server.request("GET", "/health")[2])["status"] == "ok"
    server.client.completions.create(model="tiny", prompt="count me", max_tokens=3)
    status, headers, text = server.request("GET", "/metrics")
    assert status == 200 and headers["content-type"].startswith("text/plain")
    for name in ("griffin_queue_length", "griffin_running_batch_size", "griffin_generation_tokens_per_second",
                 "griffin_prefix_cache_hits_total", "griffin_time_to_first_token_seconds_bucket",
                 "griffin_time_per_output_token_seconds_bucket"):
        assert f"\n{name}" in text
    assert server.metric("griffin_generation_tokens_total") >= 3
    assert server.metric("griffin_time_to_first_token_seconds_count") >= 1
    tokens = json.loads(server.request("POST", "/tokenize", {"prompt": "hé"})[2])["tokens"]
    assert tokens == list("hé".encode())
    assert json.loads(server.request("POST", "/detokenize", {"tokens": tokens})[2])["prompt"] == "hé"
    info = json.loads(server.request("GET", "/tokenizer_info")[2])
    assert "eos_token" in info and "<|assistant|>" in info["chat_template"]


def test_griffin_serve_command_serves_a_checkpoint_and_shuts_down_gracefully(gen, tmp_path):
    save_pretrained(tiny_model(gen, "hawk-tiny"), tmp_path / "hawk")
    port = free_port()
    env = dict(os.environ, PYTHONUNBUFFERED="1")
    proc = subprocess.Popen([sys.executable, "-m", "griffin.cli", "serve", str(tmp_path / "hawk"), "--port",
                             str(port), "--max-batch-size", "4", "--shutdown-grace", "10", "--log-level", "warning"],
                            env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        client = openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="unused", max_retries=0)
        deadline = time.monotonic() + 120
        while True:
            try:
                assert [m.id for m in client.models.list().data] == ["hawk"]
                break
            except openai.APIConnectionError:
                assert proc.poll() is None and time.monotonic() < deadline, proc.stdout.read()
                time.sleep(0.2)
        chunks = iter(client.completions.create(model="hawk", prompt="a", max_tokens=300, temperature=0,
                                                stream=True))
        first = next(chunks)
        proc.send_signal(signal.SIGTERM)  # graceful: the running request is allowed to finish
        rest = list(chunks)
        assert first.choices[0].finish_reason is None and rest[-1].choices[0].finish_reason == "length"
        assert proc.wait(timeout=60) in (0, -signal.SIGTERM)  # uvicorn re-raises the signal once it is done
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
