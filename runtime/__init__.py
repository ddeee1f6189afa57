"""Executes decoding: model adapters, KV cache, drafters, sampling math, the decode loop."""
from runtime.decoding import Decoder, GenerationConfig, GenerationResult
from runtime.draft import Draft, Drafter
from runtime.drafters import ModelDrafter, TreeShape
from runtime.errors import RuntimeUserError
from runtime.kv_cache import KVCache
from runtime.loading import LoadedModel, check_vocab_compatible, load_model
from runtime.lookup import PromptLookupDrafter
from runtime.models import MODEL_ALIASES, resolve_model
from runtime.pipeline import ModelPool, build_decoder, eos_ids
from runtime.sampling import SamplingParams, logits_to_probs, verify_chain, verify_chain_greedy
from runtime.stats import DecodeStats
from runtime.transformer import FAMILIES, CausalLM
from runtime.tree import CompiledTree, compile_tree

__all__ = [
    "FAMILIES", "MODEL_ALIASES", "CausalLM", "DecodeStats", "Decoder", "Draft", "Drafter",
    "CompiledTree", "GenerationConfig", "PromptLookupDrafter", "TreeShape", "compile_tree", "GenerationResult", "KVCache", "LoadedModel", "ModelDrafter", "ModelPool",
    "RuntimeUserError", "SamplingParams", "build_decoder", "check_vocab_compatible", "eos_ids",
    "load_model", "logits_to_probs", "resolve_model", "verify_chain", "verify_chain_greedy",
]
