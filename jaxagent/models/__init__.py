"""Model tier: the Flax NNX decoder, its KV cache, sharding rules and checkpoint import."""

from jaxagent.models.config import PRESETS, ModelConfig, RopeScaling, preset
from jaxagent.models.llama import Decoder, KVCache, init_cache

__all__ = ["PRESETS", "ModelConfig", "RopeScaling", "preset", "Decoder", "KVCache",
           "init_cache"]
