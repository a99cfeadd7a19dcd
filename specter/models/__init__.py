"""Model registry, loading (checkpoint or synthetic) and the shared-instance hybrid model."""
from specter.models.hybrid import HybridMoEModel, hybridize
from specter.models.loading import load_model
from specter.models.registry import FULL_MODELS, REGISTRY, TINY_MODELS, ModelSpec, get_spec

__all__ = ["FULL_MODELS", "REGISTRY", "TINY_MODELS", "HybridMoEModel", "ModelSpec", "get_spec", "hybridize",
           "load_model"]
