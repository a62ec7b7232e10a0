"""The three experiments' grids follow their stated rules, and bad input is refused by name."""

from __future__ import annotations

import math
from pathlib import Path

import pytest

from griffin.cli import main
from griffin.config import PAPER_SIZES, ModelConfig
from griffin.experiments.long_context import long_context_grid
from griffin.experiments.scaling import CPU_LADDER, PAPER_TOKENS, paper_ladder, scaling_grid, shape
from griffin.experiments.window import window_grid

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.parametrize("width", [32, 40, 48, 56, 64, 256, 768, 2048])
def test_ladder_shapes_follow_the_rules(width):
    s = shape(width, 3, 128)
    cfg = ModelConfig(family="griffin", **s)  # a buildable model
    assert abs(cfg.rnn_width - 4 * width / 3) <= 8 and cfg.rnn_width % 16 == 0  # D_RNN ~ 4D/3
    assert cfg.mlp_width == 3 * width  # MLP expansion 3
    assert cfg.num_kv_heads == 1 and cfg.num_heads * cfg.head_dim == width
    assert cfg.head_dim == (128 if width >= 256 else width // 2)
    assert cfg.lru_width % cfg.gate_blocks == 0 and cfg.gate_blocks == min(16, cfg.rnn_width // 16)
    assert cfg.attention_window == 64 and cfg.block_types == ("recurrent", "recurrent", "local_attention")


def test_the_cpu_ladder_trains_tokens_in_proportion_to_parameters_with_one_lr_rule():
    grid = scaling_grid(budget=0.5)
    assert len(grid.runs) == 15 and {r.tags["family"] for r in grid.runs} == {"mqa", "hawk", "griffin"}
    for run in grid.runs:
        ratio = run.tags["tokens"] / run.tags["parameters"]
        assert ratio == pytest.approx(0.5 * CPU_LADDER.tokens_per_parameter, rel=0.02)
        assert run.settings["lr"] == pytest.approx(3e-3 * math.sqrt(128 / run.tags["width"]))
        assert run.settings["seq_len"] == 128 and run.settings["batch_size"] == 16
    params = [r.tags["parameters"] for r in grid.runs if r.tags["family"] == "griffin"]
    assert params == sorted(params) and params[-1] / params[0] > 3
    grid.check()


def test_the_paper_ladder_has_the_papers_sizes_and_tokens():
    ladder = paper_ladder(ROOT / "configs/experiments/scaling-paper.toml")
    grid = ladder.grid()
    names = [r.name for r in grid.runs]
    assert names[-1] == "griffin-14b" and "mqa-14b" not in names and len(names) == 19
    for run in grid.runs:
        size = run.tags["rung"]
        width, rnn, depth, heads = PAPER_SIZES[size]
        model = run.settings["model"]
        assert (model["width"], model["rnn_width"], model["depth"], model["num_heads"]) == (width, rnn, depth, heads)
        assert run.tags["tokens"] == pytest.approx(PAPER_TOKENS[size], rel=1e-3)
        assert run.settings["seq_len"] == 2048 and run.settings["batch_size"] * run.settings["grad_accum"] == 256
    quick = ladder.grid(budget=0.1)
    assert quick.runs[0].settings["max_steps"] == pytest.approx(grid.runs[0].settings["max_steps"] / 10, abs=1)


def test_a_batch_split_over_ranks_keeps_the_global_batch():
    grid = long_context_grid()
    grid.split_batch(4)
    assert [r.settings["batch_size"] for r in grid.runs[:2]] == [8, 2]  # of 32 at T and 8 at 4T


def test_long_context_and_window_grids_keep_the_tokens_fixed():
    grid = long_context_grid()
    assert [r.name for r in grid.runs] == ["mqa-T128", "mqa-T512", "hawk-T128", "hawk-T512", "griffin-T128",
                                           "griffin-T512"]
    for run in grid.runs:  # the same tokens and steps; the batch divided by the length factor; the window fixed
        assert run.settings["seq_len"] * run.settings["batch_size"] == 128 * 32
        assert run.settings["max_steps"] == grid.runs[0].settings["max_steps"]
        assert run.settings["model"]["attention_window"] == 64
    grid = window_grid()
    assert len(grid.runs) == 21
    for run in grid.runs:
        assert run.settings["seq_len"] * run.settings["batch_size"] == 64 * 32
    windows = {(r.tags["model"], r.tags["train_length"]): [] for r in grid.runs}
    for r in grid.runs:
        windows[r.tags["model"], r.tags["train_length"]].append(r.tags["window"])
    for length in (64, 128, 256):
        assert windows["griffin", length] == windows["mqa-local", length] == [8, 16, 32]
        assert windows["mqa", length] == [length]  # global attention
    local = next(r for r in grid.runs if r.tags["model"] == "mqa-local")
    assert set(local.settings["model"]["block_types"]) == {"local_attention"}


def test_bad_input_is_refused_by_name(tmp_path, capsys):
    with pytest.raises(ValueError, match="unknown family 'hawkk'"):
        scaling_grid(families=("hawkk",))
    with pytest.raises(ValueError, match=r"--budget=0.001 gives rung d32 .* fewer than 50: raise --budget"):
        scaling_grid(budget=0.001)
    with pytest.raises(ValueError, match="--budget=0.01 leaves 4 steps"):
        long_context_grid(budget=0.01)
    with pytest.raises(ValueError, match="--budget=-1 must be a positive number"):
        scaling_grid(budget=-1)
    bad = tmp_path / "ladder.toml"
    bad.write_text('seq_len = 64\n[[rungs]]\nsize = "5b"\n')
    with pytest.raises(ValueError, match="unknown size '5b'"):
        paper_ladder(bad)
    bad.write_text('seq_lenn = 64\n[[rungs]]\nsize = "100m"\n')
    with pytest.raises(ValueError, match="unknown ladder key 'seq_lenn'"):
        paper_ladder(bad)

    with pytest.raises(SystemExit) as exit_:
        main(["experiment", "scalling"])
    assert exit_.value.code == 2 and "did you mean scaling" in capsys.readouterr().err
    assert main(["experiment", "window", "--families", "hawk"]) == 2
    assert "--families does not apply" in capsys.readouterr().err
    assert main(["experiment", "scaling", "--families", "gryffin", "--dry-run"]) == 2
    assert "unknown family 'gryffin'" in capsys.readouterr().err
    assert main(["experiment", "scaling", "--set", "out=x", "--dry-run"]) == 2
    assert "the experiment sets out itself" in capsys.readouterr().err
    assert main(["experiment", "long-context", "--budget", "0.01"]) == 2
    assert "raise --budget" in capsys.readouterr().err
    assert main(["experiment", "window", "--data-parallel", "2", "--dry-run"]) == 2
    assert "--data-parallel needs --launcher" in capsys.readouterr().err
    with pytest.raises(ValueError, match="batch of 32 sequences cannot be shared by 3 data-parallel ranks"):
        window_grid().split_batch(3)


def test_dry_run_lists_the_runs(capsys):
    assert main(["experiment", "scaling", "--families", "hawk", "--dry-run"]) == 0
    out = capsys.readouterr().out
    assert out.startswith("scaling: 5 runs") and "hawk-d64" in out and "parameters" in out


def test_long_context_windows_are_consecutive_and_whole():
    import numpy as np

    from griffin.experiments.long_context import windows

    docs = [np.arange(10), np.arange(100, 230), np.arange(500, 564)]
    got = list(windows(docs, 64))
    assert [w.tolist() for w in got] == [list(range(100, 164)), list(range(164, 228)), list(range(500, 564))]


def test_long_context_and_window_runs_take_their_sizes_from_the_command_line(capsys):
    assert main(["experiment", "long-context", "--seq-len", "256", "--batch-size", "8", "--max-steps", "60", "--width",
                 "96", "--depth", "6", "--families", "griffin", "--dry-run"]) == 0
    out = capsys.readouterr().out
    assert "griffin-T256" in out and "griffin-T1024" in out and f"{60 * 8 * 256:,} tokens" in out
    assert main(["experiment", "scaling", "--width", "64", "--dry-run"]) == 2
    assert "come from the ladder" in capsys.readouterr().err


def test_a_runs_config_file_reads_back_equal(tmp_path):
    from griffin.training import TrainConfig
    from griffin.training.config import write_toml

    cfg = TrainConfig(model={"width": 32, "depth": 4, "block_types": ["recurrent", "attention"] * 2},
                      sample_prompt='a "quote" \\ back\tslash\n\x7f é 🦅', lr=1e-3, seq_len=64)
    write_toml(tmp_path / "run.toml", cfg.to_dict())
    assert TrainConfig.from_toml(tmp_path / "run.toml") == cfg
