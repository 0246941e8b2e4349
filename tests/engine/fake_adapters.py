"""A device adapter tier over a tiny pool with synthetic adapters, for scheduler tests without a model.

The tier, pool and scheduler are the real ones; only the host cache is a stand-in that makes zero
weights of the right shapes instead of reading PEFT files.
"""

from __future__ import annotations

from pathlib import Path

import torch

from engine.core.memory import KVCacheManager, PagePool
from engine.lora.device_tier import DeviceAdapterTier
from engine.lora.files import LoraWeights
from engine.lora.peft_config import MODULES, AdapterSpec, LoraTarget, module_features
from engine.model.config import ModelConfig, parse_model_config

TINY = parse_model_config(
    {
        "model_type": "llama",
        "architectures": ["LlamaForCausalLM"],
        "vocab_size": 128,
        "hidden_size": 16,
        "intermediate_size": 32,
        "num_hidden_layers": 2,
        "num_attention_heads": 2,
        "num_key_value_heads": 1,
        "max_position_embeddings": 512,
        "rms_norm_eps": 1e-6,
    },
    {},
)


def make_spec(adapter_id: str, rank: int, version: int = 1, model: ModelConfig = TINY) -> AdapterSpec:
    layers = tuple({m: LoraTarget(rank, 1.0) for m in MODULES} for _ in range(model.num_layers))
    params = model.num_layers * sum(rank * sum(module_features(model, m)) for m in MODULES)
    return AdapterSpec(
        adapter_id, version, Path("/nonexistent") / adapter_id, layers, MODULES, rank, params, 4 * params, (0, 0, 0)
    )


class ZeroHost:
    """Stands in for HostAdapterCache: zero A/B of the spec's shapes."""

    def __init__(self, model: ModelConfig = TINY) -> None:
        self.model = model

    def get(self, spec: AdapterSpec) -> LoraWeights:
        layers = []
        for by_module in spec.layers:
            layer = {}
            for m, target in by_module.items():
                d_in, d_out = module_features(self.model, m)
                layer[m] = (torch.zeros(target.rank, d_in), torch.zeros(d_out, target.rank))
            layers.append(layer)
        return LoraWeights(spec, tuple(layers), spec.nbytes)


def make_tier(
    num_pages: int, block_size: int, max_adapters: int
) -> tuple[KVCacheManager, DeviceAdapterTier, torch.Tensor]:
    pool = PagePool(num_pages)
    kv = KVCacheManager(pool, block_size)
    cache = torch.zeros(TINY.num_layers, num_pages, 2, block_size, TINY.num_kv_heads, TINY.head_dim)
    tier = DeviceAdapterTier(pool, cache, TINY, max_adapters, ZeroHost(), reclaim=kv.evict_cached)
    return kv, tier, cache
