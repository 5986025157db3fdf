"""Typed params: params.yaml loaded into dataclasses and validated with one-line errors.

Each pipeline stage reads its own section (``ingest``, ``filter``, ...). Loading walks
the dataclass fields, so an unknown key, a wrong type or an impossible value stops the
stage with a line such as::

    params.yaml: model.n_embd: 250 is not divisible by model.n_head=8

and a typo gets the closest key suggested (``train.max_lrr: unknown key; did you mean
'max_lr'?``). An error names the key as the user wrote it (``dpo.beta1``, ``sft.lr``):
section names come from the ``Params`` fields (lmforge.config.checks).

The sections by concern: data (lmforge.config.data), model and LoRA (.model), the
training loop (.train), post-training (.post_training), evaluation (.evaluation), the
mixture sweep (.mixture); ``Params`` (.params) holds them all, and .loader reads
params.yaml into it.
"""

from lmforge.config.checks import section_name, yaml_keys, yaml_name
from lmforge.config.data import (
    CHAT_MARKERS,
    DecontamConfig,
    DedupConfig,
    DomainFilterConfig,
    ExecutorConfig,
    FilterConfig,
    FilterKind,
    IngestConfig,
    MixConfig,
    ShardsConfig,
    SourceConfig,
    TokenizerConfig,
)
from lmforge.config.evaluation import EvaluateConfig, EvaluatePostConfig, HarnessConfig
from lmforge.config.loader import flatten, from_dict, load_params, section_dict
from lmforge.config.mixture import MixSweepConfig
from lmforge.config.model import FAMILIES, LoraConfig, ModelConfig, RopeScalingConfig
from lmforge.config.params import Params
from lmforge.config.post_training import (
    DpoConfig,
    DpoDataConfig,
    PackedDataConfig,
    SftConfig,
    SftDataConfig,
)
from lmforge.config.train import TrainConfig

__all__ = [
    "CHAT_MARKERS", "FAMILIES", "DecontamConfig", "DedupConfig", "DomainFilterConfig",
    "DpoConfig", "DpoDataConfig", "EvaluateConfig", "EvaluatePostConfig", "ExecutorConfig",
    "FilterConfig", "FilterKind", "HarnessConfig", "IngestConfig", "LoraConfig",
    "MixConfig", "MixSweepConfig", "ModelConfig", "PackedDataConfig", "Params",
    "RopeScalingConfig", "SftConfig", "SftDataConfig", "ShardsConfig", "SourceConfig",
    "TokenizerConfig", "TrainConfig", "flatten", "from_dict", "load_params",
    "section_dict", "section_name", "yaml_keys", "yaml_name",
]
