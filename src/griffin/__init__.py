"""griffin: Hawk, Griffin and the MQA Transformer baseline (De et al., 2024) in PyTorch."""

from griffin.cache import Cache
from griffin.config import PRESETS, ModelConfig
from griffin.inference import Decoder, generate, generate_stream, prefill
from griffin.interop import load_pretrained, save_pretrained
from griffin.model import CausalLM, count_parameters

__version__ = "0.1.0"
__all__ = ["Cache", "CausalLM", "Decoder", "ModelConfig", "PRESETS", "count_parameters", "generate", "generate_stream",
           "load_pretrained", "prefill", "save_pretrained"]
