"""DVC stage ``headline``: metrics/headline.json and headline.md from the stages' detail
metrics (see lmforge.headline): ``dvc metrics show`` prints the json."""

from __future__ import annotations

from lmforge.headline import write_headline

if __name__ == "__main__":
    for path in write_headline():
        print(f"headline: wrote {path}")
