"""What every ``torch.compile`` site in lmforge does first: :func:`before_compile`.

``torch._dynamo`` and ``torch._inductor`` take 1.4 s to import, and most processes that
import the model never compile (evaluation, eager and FSDP-eager training, the CLI, the
data stages' checks). So nothing at import time touches them: the deterministic-kernels
flag reaches Inductor's config here, when a process is about to compile. (The chunked
loss needs nothing: it is a registered custom op, one opaque node of any graph.)
"""

from __future__ import annotations

import torch


def before_compile() -> None:
    """Ready this process for ``torch.compile``: a deterministic-kernels flag set with
    ``torch._C`` (see ``make_reproducible``) is carried into Inductor's own copy, which
    ``torch.use_deterministic_algorithms`` sets."""
    if torch.are_deterministic_algorithms_enabled():
        torch.use_deterministic_algorithms(
            True, warn_only=torch.is_deterministic_algorithms_warn_only_enabled())
