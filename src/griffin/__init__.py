"""griffin: Hawk, Griffin and the MQA Transformer baseline (De et al., 2024) in PyTorch."""

import os

# OpenMP threads that wait for work sleep instead of spinning. Two OpenMP runtimes share the process (torch's bundled
# libgomp and the system one under numba's parallel RG-LRU kernels), and spinning workers of one starve the other's
# threads and, on a shared host, every other process (with the default, spinning, policy, forward passes, training
# steps and decode steps on the 2-core development host ran several times slower: see this line's commit message).
# Read by each runtime when it loads, so it takes effect only if griffin is imported before torch; the user's own
# setting wins.
os.environ.setdefault("OMP_WAIT_POLICY", "passive")

from griffin.cache import Cache  # noqa: E402
from griffin.config import PRESETS, ModelConfig
from griffin.inference import Decoder, generate, generate_stream, prefill
from griffin.interop import load_pretrained, save_pretrained
from griffin.model import CausalLM, count_parameters

__version__ = "0.1.0"
__all__ = ["Cache", "CausalLM", "Decoder", "ModelConfig", "PRESETS", "count_parameters", "generate", "generate_stream",
           "load_pretrained", "prefill", "save_pretrained"]
