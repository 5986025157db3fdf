"""The decoder-only transformer, its generation loop, and loading a trained model."""

from lmforge.model.generate import generate, sample_next
from lmforge.model.llama import KVCache, Llama, ffn_hidden_size, param_count_formula
from lmforge.model.saved import load_model, model_config_dict, save_model, save_weights

__all__ = [
    "KVCache", "Llama", "ffn_hidden_size", "generate", "load_model", "model_config_dict",
    "param_count_formula", "sample_next", "save_model", "save_weights",
]
