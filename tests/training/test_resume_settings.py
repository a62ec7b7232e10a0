"""Resuming starts from the run's saved settings (issue 13): what defines the run is inherited and must agree when
given again; the machine's settings (device, threads, layout) come from the resuming command."""

from __future__ import annotations

import pytest

from griffin.training.config import MACHINE_KEYS, TrainConfig


def saved_run(**changes) -> dict:
    return {**TrainConfig(preset="griffin-tiny", lr=0.02, seq_len=64, max_steps=10, **changes).to_dict()}


def test_run_settings_are_inherited_and_machine_settings_are_not():
    saved = saved_run(tp=2, dp_shard=2, threads=3, activation_checkpointing=True, device="cpu")
    cfg = TrainConfig.resuming(saved, {"max_steps": 20})
    assert (cfg.preset, cfg.lr, cfg.seq_len, cfg.max_steps) == ("griffin-tiny", 0.02, 64, 20)
    default = TrainConfig()
    for key in MACHINE_KEYS:  # a run saved on 4 processes resumes on one without repeating its layout
        assert getattr(cfg, key) == getattr(default, key), key
    assert TrainConfig.resuming(saved, {"tp": 4}).tp == 4


def test_a_run_setting_given_again_must_agree():
    saved = saved_run()
    assert TrainConfig.resuming(saved, {"lr": 0.02}).lr == 0.02
    with pytest.raises(ValueError, match=r"--lr 0\.5 disagrees with the run's lr=0\.02"):
        TrainConfig.resuming(saved, {"lr": 0.5})
