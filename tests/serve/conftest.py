"""A griffin server on 127.0.0.1 for the serve tests: a tiny model built from the test's seed, the byte-level
tokenizer, uvicorn in a thread on a free port, the real ``openai`` client."""

from __future__ import annotations

import http.client
import json
import socket
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import openai
import pytest
import torch
import uvicorn

from griffin import CausalLM, ModelConfig
from griffin.data.tokenizer import load_tokenizer
from griffin.serve.app import Server, build_app
from griffin.serve.engine import Engine
from tests.conftest import perturb_, seed_torch


def tiny_model(gen: torch.Generator, preset: str = "griffin-tiny", **overrides: Any) -> CausalLM:
    """A tiny model over bytes with its norms and biases moved off their initial values (less flat outputs)."""
    seed_torch(gen)
    model = CausalLM(ModelConfig.from_preset(preset, vocab_size=256, **overrides)).eval()
    perturb_(model, gen, 0.5)
    return model


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@dataclass
class Running:
    """A server running in this process."""

    port: int
    engine: Engine
    model: CausalLM
    client: openai.OpenAI
    uvicorn: uvicorn.Server
    thread: threading.Thread

    def request(self, method: str, path: str, body: bytes | dict | None = None) -> tuple[int, dict[str, str], str]:
        """A raw HTTP request: status, headers, body text."""
        if isinstance(body, dict):
            body = json.dumps(body).encode()
        conn = http.client.HTTPConnection("127.0.0.1", self.port, timeout=60)
        conn.request(method, path, body=body, headers={"Content-Type": "application/json"})
        r = conn.getresponse()
        text = r.read().decode()
        conn.close()
        return r.status, dict(r.getheaders()), text

    def metric(self, name: str) -> float:
        _, _, text = self.request("GET", "/metrics")
        for line in text.splitlines():
            if line.startswith(name + " "):
                return float(line.split()[1])
        raise KeyError(name)

    def stop(self) -> None:
        self.uvicorn.should_exit = True
        self.thread.join(timeout=30)


def start_server(model: CausalLM, model_name: str = "tiny", **engine_options: Any) -> Running:
    tokenizer = load_tokenizer("bytes")
    options = dict(max_batch=8, prefill_chunk=16)
    options.update(engine_options)
    engine = Engine(model, tokenizer, **options)
    engine.warmup()  # as griffin serve does: a cold numba cache compiles here, not inside a client's timeout
    app = build_app(Server(engine, tokenizer, model_name))
    port = free_port()
    server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=port, log_level="warning",
                                           timeout_graceful_shutdown=1))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    deadline = time.monotonic() + 30
    while not server.started:
        if time.monotonic() > deadline or not thread.is_alive():
            raise RuntimeError("the test server did not start")
        time.sleep(0.01)
    client = openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="unused", max_retries=0, timeout=60)
    return Running(port, engine, model, client, server, thread)


@pytest.fixture
def server(gen: torch.Generator) -> Iterator[Running]:
    running = start_server(tiny_model(gen))
    yield running
    running.stop()
