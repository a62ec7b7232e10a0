"""griffin.heap: the C heap keeps what a CPU training step frees, unless the user set the allocator up."""

from __future__ import annotations

import json
import os
import platform
import subprocess
import sys

import pytest

import griffin.cli
from griffin.heap import keep_freed_memory

GLIBC = sys.platform == "linux" and platform.libc_ver()[0] == "glibc"

# Page faults (fresh memory) of each of 8 eager training steps of the synthetic Hawk at T = 1,024, in a new process
STEPS = r"""
import json, resource, sys
if sys.argv[1] == "keep":
    from griffin.heap import keep_freed_memory
    assert keep_freed_memory()
import torch
from griffin import CausalLM, ModelConfig

torch.manual_seed(0)
torch.set_num_threads(1)
model = CausalLM(ModelConfig.from_preset("hawk-synthetic"))
opt = torch.optim.AdamW(model.parameters())
x = torch.randint(0, 16, (8, 1024))
positions = torch.arange(1024).expand(8, -1)
faults = []
for _ in range(8):
    before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
    model(x, positions, targets=x).backward()
    opt.step()
    opt.zero_grad()
    faults.append(resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before)
print(json.dumps(faults))
"""


def step_faults(mode: str) -> list[int]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("MALLOC_") and k != "GLIBC_TUNABLES"}
    out = subprocess.run([sys.executable, "-c", STEPS, mode], env=env, capture_output=True, text=True, check=True)
    return json.loads(out.stdout.strip().splitlines()[-1])


@pytest.mark.skipif(not GLIBC, reason="the setting is glibc's (mallopt)")
def test_training_steps_reuse_freed_memory_instead_of_faulting_in_new_pages():
    """With glibc's defaults the steps after the first three still fault in thousands of fresh pages (freed blocks
    given back to the OS and mapped again); with keep_freed_memory() they reuse the heap: a fifth as many at most
    (measured: a few pages a step, now and then a thousand where the heap grows, against 2,000-36,000)."""
    default, kept = step_faults("default"), step_faults("keep")
    assert sum(default[3:]) > 2000, f"glibc's defaults did not churn here: {default}"
    assert 5 * sum(kept[3:]) < sum(default[3:]), f"page faults per step: {kept} kept, {default} with the defaults"


@pytest.mark.parametrize("name, value", [("MALLOC_TRIM_THRESHOLD_", "131072"), ("MALLOC_MMAP_THRESHOLD_", "65536"),
                                         ("GLIBC_TUNABLES", "glibc.malloc.trim_threshold=131072"),
                                         ("LD_PRELOAD", "/usr/lib/x86_64-linux-gnu/libjemalloc.so.2")])
def test_the_users_allocator_settings_win(monkeypatch, name, value):
    monkeypatch.setenv(name, value)
    assert keep_freed_memory() is False


@pytest.mark.parametrize("command, keeps", [("train", True), ("synth", True), ("finetune", True),
                                            ("generate", False), ("serve", False)])
def test_the_commands_that_train_keep_freed_memory(monkeypatch, command, keeps):
    calls = []
    monkeypatch.setattr(griffin.cli, "keep_freed_memory", lambda: calls.append(command))
    with pytest.raises(SystemExit):
        griffin.cli.main([command, "--help"])
    assert calls == ([command] if keeps else [])
