"""How OpenMP's idle threads wait (griffin.threads): set by explicit calls, the griffin command's and the first
parallel kernel's, never by importing griffin."""

import os
import subprocess
import sys

import pytest

# Prints OMP_WAIT_POLICY after importing griffin (and its model), then after a CPU scan (a parallel numba kernel).
SCRIPT = """
import os
import torch
import griffin
from griffin import CausalLM
print(os.environ.get("OMP_WAIT_POLICY"))
from griffin.ops.scan import linear_scan
linear_scan(torch.rand(1, 8, 4), torch.rand(1, 8, 4), backend="cpu")
print(os.environ.get("OMP_WAIT_POLICY"))
"""


@pytest.mark.parametrize("own", [None, "active"])
def test_the_first_parallel_kernel_sets_passive_waiting_unless_the_program_chose(own):
    env = {k: v for k, v in os.environ.items() if k != "OMP_WAIT_POLICY"}
    if own:
        env["OMP_WAIT_POLICY"] = own
    run = subprocess.run([sys.executable, "-c", SCRIPT], env=env, capture_output=True, text=True, timeout=600)
    assert run.returncode == 0, run.stderr[-3000:]
    after_import, after_kernel = run.stdout.split()
    assert after_import == str(own)  # importing griffin changes nothing
    assert after_kernel == (own or "passive")
