"""Specter: fast MoE inference via quantization-enabled multi-step speculative offloading."""
from specter.config import SpecterConfig
from specter.engine import SpecterEngine
from specter.errors import SpecterError
from specter.metrics import GenerationResult
from specter.models import HybridMoEModel, load_model
from specter.text import TextResult, generate_text

__all__ = ["GenerationResult", "HybridMoEModel", "SpecterConfig", "SpecterEngine", "SpecterError", "TextResult",
           "generate_text", "load_model"]
__version__ = "0.1.0"
