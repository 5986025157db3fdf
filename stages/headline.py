"""DVC stage ``headline``: metrics/headline/{base,sft,dpo}.json from the stages' detail
metrics (see lmforge.headline): the only files ``dvc metrics show`` prints."""

from __future__ import annotations

from lmforge.headline import write_headline

if __name__ == "__main__":
    for path in write_headline():
        print(f"headline: wrote {path}")
