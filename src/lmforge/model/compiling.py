"""What every ``torch.compile`` site in lmforge does first: :func:`before_compile`.

``torch._dynamo`` and ``torch._inductor`` take 1.4 s to import, and most processes that
import the model never compile (evaluation, eager and FSDP-eager training, the CLI, the
data stages' checks). So nothing at import time touches them: the fused loss is kept out
of compiled graphs, and the deterministic-kernels flag reaches Inductor's config, here,
when a process is about to compile.
"""

from __future__ import annotations

import torch

from lmforge.model.loss import keep_out_of_compiled_graphs


def before_compile() -> None:
    """Ready this process for ``torch.compile``: the chunked loss stays eager, and a
    deterministic-kernels flag set with ``torch._C`` (see ``make_reproducible``) is
    carried into Inductor's own copy, which ``torch.use_deterministic_algorithms`` sets."""
    keep_out_of_compiled_graphs()
    if torch.are_deterministic_algorithms_enabled():
        torch.use_deterministic_algorithms(
            True, warn_only=torch.is_deterministic_algorithms_warn_only_enabled())
