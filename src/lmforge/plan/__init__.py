"""Memory planning before launch (``lmforge plan``): pretraining and fine-tuning.

The modules, each building only on those above it:

- ``shapes``: what is planned (:class:`Setup`), the preset model shapes (``SHAPES``),
  parameter shapes and counts, bytes per dtype, sizes as the tables print them;
- ``memory``: what a training step holds per rank under DDP and FSDP2, row by row
  (model states, weight copies, loss buffers, activations), the device's reserve and
  the largest micro-batch within a budget;
- ``pretrain``: the pretraining plan, both strategies side by side (:func:`plan`);
- ``finetune``: one device's full, LoRA or QLoRA fine-tuning, without and with
  activation checkpointing, and a verdict (:func:`finetune_plan`);
- ``cli``: the ``lmforge plan`` command and the tables it prints.
"""

from lmforge.plan.finetune import MODES, Tune, finetune_plan, preset_tune
from lmforge.plan.pretrain import STRATEGIES, plan
from lmforge.plan.shapes import SHAPES, Setup, num_params

__all__ = ["MODES", "SHAPES", "STRATEGIES", "Setup", "Tune", "finetune_plan", "num_params",
           "plan", "preset_tune"]
