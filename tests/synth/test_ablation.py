"""`silenced_prefix`: the RG-LRU writes nothing before the trigger, so the prefix cannot reach what follows (beyond the
Conv1D's reach), across the chunks of a cached forward as in one plain forward; the model is restored on exit.
`answer_shares`: each share is the state the RG-LRU reaches writing only at its positions, and the three sum to the
state at the final trigger; `answer_channels` names the channel where the answer's share stands out."""

from __future__ import annotations

import json

import pytest
import torch

from griffin.cli import main
from griffin.layers.rg_lru import RGLRU
from griffin.ops.rg_lru import rg_lru_ref
from griffin.synth import InductionHeads, SelectiveCopying, train_task
from griffin.synth.ablation import SHARES, answer_channels, answer_shares, silenced_prefix
from griffin.synth.evaluate import answer_logits, answer_logits_ref, forward_with_hooks
from tests.synth.test_evaluate import tiny_model

TRIGGER = InductionHeads.TRIGGER


def with_trigger(ids: torch.Tensor, at: list[int]) -> torch.Tensor:
    ids = ids.clamp(min=1)  # no trigger elsewhere
    ids[torch.arange(len(at)), torch.tensor(at)] = TRIGGER
    return ids


def test_a_silenced_prefix_does_not_reach_past_the_trigger(gen):
    model = tiny_model("hawk", gen)
    reach = model.config.conv1d_width - 1  # the Conv1D mixes the tokens just before the trigger into it
    at = [30, 41]
    a = with_trigger(torch.randint(0, 16, (2, 60), generator=gen), at)
    b = a.clone()
    for row, p in enumerate(at):  # another prefix, the same tokens from reach before the trigger on
        b[row, : p - reach] = torch.randint(1, 16, (p - reach,), generator=gen)
    with torch.no_grad():
        plain = model(a), model(b)
        with silenced_prefix(model, TRIGGER):
            silenced = model(a), model(b)
    for row, p in enumerate(at):
        assert not torch.allclose(plain[0][row, p:], plain[1][row, p:], atol=1e-4)  # the prefix reaches on unsilenced
        torch.testing.assert_close(silenced[0][row, p:], silenced[1][row, p:], rtol=0, atol=1e-5)
        # before the trigger the state stays empty: the prefix's own outputs still depend on its tokens
        assert not torch.allclose(silenced[0][row, : p - reach], silenced[1][row, : p - reach])


@pytest.mark.parametrize("family", ["hawk", "griffin"])
def test_the_chunked_forward_carries_the_silence_across_chunks(family, gen):
    model = tiny_model(family, gen)
    ids = with_trigger(torch.randint(0, 16, (3, 50), generator=gen), [3, 22, 45])  # in the first, third, last chunk
    targets = torch.full_like(ids, -100)
    targets[:, -1] = 5
    with torch.no_grad():
        plain = answer_logits_ref(model, ids, targets)
        with silenced_prefix(model, TRIGGER):
            ref = answer_logits_ref(model, ids, targets)
            chunked = answer_logits(model, ids, targets, chunk_size=7)
        restored = answer_logits(model, ids, targets, chunk_size=7)
    torch.testing.assert_close(chunked, ref, rtol=1e-5, atol=1e-5)
    assert not torch.allclose(ref, plain, atol=1e-4)
    torch.testing.assert_close(restored, plain, rtol=1e-5, atol=1e-5)  # restored on exit
    assert sum(isinstance(m, RGLRU) for m in model.modules()) == model.config.block_types.count("recurrent")


def test_answer_shares_are_the_states_of_the_writes_at_their_positions(gen):
    model = tiny_model("hawk", gen).double()
    at = [0, 9, 30, 36]  # the first position, the middle, and answers whose window reaches the final trigger
    ids = with_trigger(torch.randint(0, 16, (4, 40), generator=gen), at)
    ids[:, -1] = TRIGGER
    seen = []
    forward_with_hooks(model, ids, [m for m in model.modules() if isinstance(m, RGLRU)],
                       lambda mod, args, out: seen.append((mod, *args[:2], out[0])))
    shares = answer_shares(model, ids, TRIGGER)
    assert len(shares) == len(seen) == model.config.block_types.count("recurrent")
    t = torch.arange(ids.shape[1])[None, :]
    p, width = torch.tensor(at)[:, None], model.config.conv1d_width
    masks = {"prefix": t < p, "answer": (t >= p) & (t < p + width), "after": t >= p + width}
    for (lru, x, reset, y), (parts, log_a) in zip(seen, shares, strict=True):
        assert reset is not None and reset[:, 0].all()  # the document start resets the state at position 0
        assert parts.shape == (3, 4, x.shape[-1]) and parts.dtype == torch.float64
        torch.testing.assert_close(parts.sum(0), y[:, -1])  # the state at the final trigger, exactly split
        for k, name in enumerate(SHARES):  # the recurrence run writing only at that share's positions
            with torch.no_grad():
                only, _ = rg_lru_ref(x * masks[name][..., None], lru.input_gate(x), lru.a_gate(x), lru.a_param, lru.c,
                                     None, reset)
            torch.testing.assert_close(parts[k], only[:, -1])
        with torch.no_grad():
            torch.testing.assert_close(log_a, lru.decay(x).log().mean(dim=(0, 1)))
    assert shares[0][0][0, 0].abs().sum() == 0  # a trigger at position 0: nothing before it
    ids[2, :-1] = ids[2, :-1].clamp(min=1)
    with pytest.raises(ValueError, match=r"rows \[2\] have no trigger \(token 0\) before their last position"):
        answer_shares(model, ids, TRIGGER)


def test_answer_channels_name_the_channel_where_the_answer_stands_out():
    parts = torch.full((3, 5, 4), 0.1, dtype=torch.float64)
    parts[1, :, 2] = 3.0  # channel 2: the answer 3, the rest 0.1 + 0.1
    parts[1, :, 0] = 0.05
    log_a = torch.tensor([-0.1, -0.01, -0.001, -1.0], dtype=torch.float64)
    (row,) = answer_channels([(parts, log_a)])
    assert row["channel"] == 2 and row["ratio"] == pytest.approx(15.0) and row["answer"] == pytest.approx(3.0)
    assert row["prefix"] == pytest.approx(0.1) and row["after"] == pytest.approx(0.1)
    assert row["horizon"] == pytest.approx(1000.0) and row["channels_over_1"] == 1
    state = parts.sum(0)  # every row alike: 0.3 in three channels, 3.2 in one
    assert row["state_rms"] == pytest.approx(float(state[0].pow(2).mean().sqrt()))


def test_refused_without_an_rg_lru(gen):
    with pytest.raises(ValueError, match="mqa model has no RG-LRU"), silenced_prefix(tiny_model("mqa", gen), TRIGGER):
        pass


def test_command_line(tmp_path, capsys, gen):
    quick = dict(steps=2, batch_size=2, eval_every=1, eval_sequences=4, progress=False, tensorboard=False, window=8)
    train_task(InductionHeads(seq_len=16), "hawk", tmp_path / "hawk", **quick)
    args = ["synth", "eval", str(tmp_path / "hawk"), "--lengths", "16", "40", "--sequences", "4", "--no-progress",
            "--distance-bins", "2", "--silence-prefix"]
    assert main(args) == 0
    assert "writes silenced before the first trigger" in capsys.readouterr().out
    record = json.loads((tmp_path / "hawk" / "lengths.json").read_text())
    assert [r["length"] for r in record["silenced_prefix"]] == [16, 40]
    assert all(len(r["by_distance"]) == 2 for r in record["silenced_prefix"])
    assert (tmp_path / "hawk" / "silenced_prefix.png").stat().st_size > 0
    assert main(["synth", "eval", str(tmp_path / "hawk"), "--lengths", "16", "40", "--sequences", "3",
                 "--eval-batch-size", "2", "--no-progress", "--answer-channels", "--out", str(tmp_path / "ac")]) == 0
    assert "the answer's channel per recurrent block" in capsys.readouterr().out
    record = json.loads((tmp_path / "ac" / "lengths.json").read_text())
    recurrent = [i for i, k in enumerate(record_config(tmp_path / "hawk")) if k == "recurrent"]
    assert [(r["length"], r["sequences"]) for r in record["answer_channels"]] == [(16, 3), (40, 3)]
    assert all([b["block"] for b in r["blocks"]] == recurrent for r in record["answer_channels"])
    assert (tmp_path / "ac" / "answer_channels.png").stat().st_size > 0
    train_task(InductionHeads(seq_len=16), "mqa", tmp_path / "mqa", **quick)
    for flag in ("--silence-prefix", "--answer-channels"):
        assert main(["synth", "eval", str(tmp_path / "mqa"), "--lengths", "16", flag]) == 2
        assert "no RG-LRU" in capsys.readouterr().err
    train_task(SelectiveCopying(seq_len=24, num_data=4), "hawk", tmp_path / "copying", **quick)
    for flag in ("--silence-prefix", "--answer-channels"):
        assert main(["synth", "eval", str(tmp_path / "copying"), "--lengths", "24", flag]) == 2
        assert "was trained on selective_copying" in capsys.readouterr().err


def record_config(run) -> list[str]:
    return json.loads((run / "config.json").read_text())["block_types"]


def test_the_cache_may_be_passed_by_position(gen):
    model = tiny_model("hawk", gen)
    ids = with_trigger(torch.randint(0, 16, (2, 20), generator=gen), [3, 12])
    with torch.no_grad(), silenced_prefix(model, TRIGGER):
        whole = model(ids)
        cache = model.init_cache(2, None)
        parts = torch.cat([model(ids[:, :8], None, cache), model(ids[:, 8:], None, cache)], 1)
    torch.testing.assert_close(parts, whole, rtol=1e-5, atol=1e-5)
