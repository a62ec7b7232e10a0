"""griffin: Hawk, Griffin and the MQA Transformer baseline (De et al., 2024) in PyTorch."""

from griffin.config import PRESETS, ModelConfig, count_parameters
from griffin.model import CausalLM, ResidualBlock

__version__ = "0.1.0"
__all__ = ["CausalLM", "ModelConfig", "PRESETS", "ResidualBlock", "count_parameters"]
