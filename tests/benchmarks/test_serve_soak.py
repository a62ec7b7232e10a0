"""``benchmarks/serve_soak.py`` for one minute: a small Griffin with two LoRA adapters behind ``griffin serve`` (a
subprocess), under the soak's seeded mix of completions, shared-prefix chats, cut streams, abandoned requests,
adapters, JSON requests and bad requests. Nothing is a 5xx or lost, every bad request gets a 4xx, every finished JSON
reply validates, cut requests are cancelled, and the server drains, still answers, and exits cleanly on SIGINT with
nothing in its log. (RSS flatness is judged on the 20-minute run only; it is reported here.)"""

from __future__ import annotations

import json

import pytest

from tests.benchmarks.test_inference_benchmark import load_benchmark


@pytest.mark.slow
def test_a_one_minute_soak_with_faults_gets_no_server_error_and_loses_nothing(tmp_path):
    out, figure = tmp_path / "soak.json", tmp_path / "soak.png"
    argv = ["--minutes", "1", "--rate", "1", "--sample-s", "2", "--out", str(out), "--figure", str(figure)]
    assert load_benchmark("serve_soak").main(argv) == 0
    results = json.loads(out.read_text())
    s = results["summary"]
    assert s["requests"] >= 30
    assert s["status_classes"]["5xx"] == 0 and s["server_errors"] == 0
    assert s["lost"] == 0 and s["good_refused_4xx"] == 0, s["errors"]
    bad = s["bad_requests"]
    assert bad["sent"] > 0 and bad["got_4xx"] == bad["sent"], bad["by_name"]
    assert s["json"]["schema_finished"] > 0 and s["json"]["schema_valid"] == s["json"]["schema_finished"]
    assert s["json"]["valid"] == s["json"]["finished"]
    for kind in ("completion", "fewshot", "chat", "json_schema"):
        assert s["kinds"][kind]["ok"] > 0, kind
    assert s["kinds"]["cut_stream"]["cut"] > 0
    # a cut request is cancelled: the server generates a few tokens for it, not its max_tokens
    assert s["cancellation"]["generated_per_cut_request"] < 0.5 * s["cancellation"]["cut_max_tokens"]
    assert set(s["models"]) == {"bench", "a", "b"} and all(n > 0 for n in s["models"].values())
    assert s["prefix"]["hits"] > 0 and s["prefix"]["prompt_tokens_computed"] < s["prefix"]["prompt_tokens"]
    assert s["drained_s"] is not None
    assert s["final"]["health_status"] == 200 and s["final"]["request_ok"]
    down = results["shutdown"]
    assert down["clean"] and not down["killed"] and down["exit_code"] in (0, 130)
    assert down["log_error_lines"] == 0, down["log_errors"]
    assert len(results["samples"]) >= 10 and s["rss"]["start_mib"] > 0
    assert results["verdict"]["ok"] and figure.stat().st_size > 0
