"""How OpenMP's idle threads wait (griffin.threads): set by explicit calls, the griffin command's and the first
parallel kernel's, never by importing griffin."""

import os
import re
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


# A training process's setting, then a parallel numba kernel (which starts numba's OpenMP runtime).
TRAINING = """
import os
import griffin.threads
griffin.threads.prefer_training_openmp_wait()
import torch
from griffin.ops.scan import linear_scan
linear_scan(torch.rand(1, 8, 4), torch.rand(1, 8, 4), backend="cpu")
print(os.environ.get("OMP_WAIT_POLICY"), os.environ.get("GOMP_SPINCOUNT"))
"""


def spincounts(stderr: str) -> list[str]:
    """GOMP_SPINCOUNT as each OpenMP runtime the process loaded displayed it (OMP_DISPLAY_ENV), in load order."""
    return re.findall(r"GOMP_SPINCOUNT = '(\d+)'", stderr)


def display_env(own: dict[str, str]) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k not in ("OMP_WAIT_POLICY", "GOMP_SPINCOUNT")}
    return {**env, **own, "OMP_DISPLAY_ENV": "VERBOSE"}


@pytest.mark.parametrize("own", [{}, {"GOMP_SPINCOUNT": "5"}, {"OMP_WAIT_POLICY": "passive"}])
def test_training_spins_torch_workers_and_keeps_numba_passive_unless_the_program_chose(own):
    """torch's runtime (loaded first) reads TRAINING_SPINCOUNT, numba's (loaded by the kernel) 0: passive; the
    variable is gone from the environment afterwards. The environment's own setting applies to both."""
    from griffin.threads import TRAINING_SPINCOUNT

    run = subprocess.run([sys.executable, "-c", TRAINING], env=display_env(own), capture_output=True, text=True,
                         timeout=600)
    assert run.returncode == 0, run.stderr[-3000:]
    torch_spins, numba_spins = spincounts(run.stderr)
    if not own:
        assert (torch_spins, numba_spins) == (str(TRAINING_SPINCOUNT), "0")
        assert run.stdout.split() == ["passive", "None"]
    else:
        assert torch_spins == numba_spins == own.get("GOMP_SPINCOUNT", "0")


@pytest.mark.parametrize("argv, trains", [(["--debug", "train", "--help"], True), (["synth", "--help"], True),
                                          (["presets"], False)])
def test_the_commands_that_train_spin_torch_workers(argv, trains):
    from griffin.threads import TRAINING_SPINCOUNT

    run = subprocess.run([sys.executable, "-m", "griffin.cli", *argv], env=display_env({}), capture_output=True,
                         text=True, timeout=600)
    assert run.returncode == 0, run.stderr[-3000:]
    assert spincounts(run.stderr)[0] == (str(TRAINING_SPINCOUNT) if trains else "0")
