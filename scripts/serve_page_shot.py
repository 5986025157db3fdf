"""Drive ``lmforge serve``'s page at ``/`` in a real headless Chromium (Selenium with
Debian's ``chromium`` and ``chromium-driver``): type a prompt, send it, wait for every
model's answer, read the columns and save a screenshot.

    lmforge serve &                      # or any --model list
    python scripts/serve_page_shot.py --prompt 'def fibonacci(n):' --mode completion \\
        --out docs/img/serve_page.png

tests/test_serve_browser.py uses the same functions against a server it starts. Nothing
is downloaded: the browser and its driver are the ones installed (``apt-get install
chromium chromium-driver``), found on PATH and handed to Selenium, so that Selenium
Manager never looks for one of its own.
"""

from __future__ import annotations

import argparse
import io
import json
import shutil
import sys
from pathlib import Path

BROWSERS = ("chromium", "chromium-browser", "google-chrome")
DRIVER = "chromedriver"
# The page's flags: no sandbox (CI runs as root), /tmp instead of a small /dev/shm.
FLAGS = ("--headless=new", "--no-sandbox", "--disable-dev-shm-usage", "--disable-gpu",
         "--hide-scrollbars", "--force-device-scale-factor=1")


def find_browser() -> tuple[str, str] | str:
    """(browser, driver) paths, or a one-line reason why there is none."""
    try:
        import selenium  # noqa: F401
    except ImportError:
        return "selenium is not installed (pip install selenium)"
    browser = next((p for p in map(shutil.which, BROWSERS) if p), None)
    if browser is None:
        return "no Chromium installed (apt-get install chromium chromium-driver)"
    driver = shutil.which(DRIVER)
    if driver is None:
        return "no chromedriver installed (apt-get install chromium-driver)"
    return browser, driver


def open_browser(browser: str, driver: str, width: int = 1280, height: int = 900):
    """A headless Chromium at ``width`` x ``height`` CSS pixels."""
    from selenium import webdriver
    from selenium.webdriver.chrome.service import Service

    options = webdriver.ChromeOptions()
    options.binary_location = browser
    for flag in FLAGS:
        options.add_argument(flag)
    options.add_argument(f"--window-size={width},{height}")
    return webdriver.Chrome(options=options, service=Service(executable_path=driver))


def load_page(drv, url: str, timeout: float = 30.0) -> list[str]:
    """Open the page and wait until its model columns are drawn; their names, in order."""
    from selenium.webdriver.common.by import By
    from selenium.webdriver.support.ui import WebDriverWait

    drv.get(url)
    WebDriverWait(drv, timeout).until(
        lambda d: d.find_elements(By.CSS_SELECTOR, "#columns .model")
        or d.find_element(By.ID, "status").text)
    status = drv.find_element(By.ID, "status").text
    if status:
        raise RuntimeError(f"the page says: {status}")
    return [box.get_attribute("data-model")
            for box in drv.find_elements(By.CSS_SELECTOR, "#columns .model")]


def fill(drv, element_id: str, value: str) -> None:
    """Type ``value`` into the page's input ``element_id`` as a user would (cleared first)."""
    from selenium.webdriver.common.by import By

    box = drv.find_element(By.ID, element_id)
    box.clear()
    box.send_keys(value)


def ask(drv, prompt: str, mode: str = "chat", max_tokens: int = 64,
        system: str = "", timeout: float = 120.0) -> dict[str, dict[str, str]]:
    """Type ``prompt`` (and the settings), press Send and wait until every column is done:
    {model: {"answer", "meta", "done", "figures"}} as the page shows them."""
    from selenium.webdriver.common.by import By
    from selenium.webdriver.support.ui import Select, WebDriverWait

    fill(drv, "system", system)
    fill(drv, "prompt", prompt)
    fill(drv, "max_tokens", str(max_tokens))
    Select(drv.find_element(By.ID, "mode")).select_by_value(mode)
    # Forget the last round's marks first, so that the wait below sees only this one's.
    drv.execute_script("document.querySelectorAll('.model').forEach("
                       "b => delete b.dataset.done)")
    invalid = drv.execute_script(  # the browser would not submit: say why, not time out
        "return [...document.querySelectorAll('#ask :invalid')]"
        ".map(e => e.id + ': ' + e.validationMessage)")
    if invalid:
        raise RuntimeError(f"the browser refuses to send the form: {'; '.join(invalid)}")
    drv.find_element(By.ID, "send").click()
    WebDriverWait(drv, timeout).until(lambda d: d.execute_script(
        "return [...document.querySelectorAll('.model')].every(b => b.dataset.done)"
        " && !document.getElementById('send').disabled"))
    return columns(drv)


def columns(drv) -> dict[str, dict[str, str]]:
    """What each model's column shows: its answer (the text, exactly), the line under
    it, its headline figures and how it ended (``data-done``: true or error)."""
    return drv.execute_script("""
        const out = {};
        for (const b of document.querySelectorAll('.model')) {
          const text = (sel) => b.querySelector(sel).textContent;
          out[b.dataset.model] = {answer: text('.answer'), meta: text('.meta'),
                                  figures: text('.figures'), done: b.dataset.done || ''};
        }
        return out;""")


def screenshot(drv, path: Path, colours: int | None = None) -> Path:
    """Save the page as a PNG at ``path``, grown to the page's full height; ``colours``
    (with Pillow) reduces it to that many colours, which keeps a text page small."""
    height = drv.execute_script("return document.documentElement.scrollHeight")
    width = drv.execute_script("return document.documentElement.scrollWidth")
    drv.set_window_size(width, height + 120)  # + the window's frame
    png = drv.get_screenshot_as_png()
    if colours:
        from PIL import Image

        with Image.open(io.BytesIO(png)) as image:
            out = io.BytesIO()
            image.convert("RGB").quantize(colours).save(out, "PNG", optimize=True)
            png = out.getvalue()
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(png)
    return path


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--url", default="http://127.0.0.1:8000/")
    p.add_argument("--prompt", required=True)
    p.add_argument("--system", default="")
    p.add_argument("--mode", choices=["chat", "completion"], default="chat")
    p.add_argument("--max-tokens", type=int, default=64)
    p.add_argument("--width", type=int, default=1280)
    p.add_argument("--colours", type=int, default=64, help="0: keep every colour")
    p.add_argument("--out", type=Path, required=True)
    args = p.parse_args()
    found = find_browser()
    if isinstance(found, str):
        sys.exit(f"serve_page_shot: {found}")
    drv = open_browser(*found, width=args.width)
    try:
        load_page(drv, args.url)
        shown = ask(drv, args.prompt, args.mode, args.max_tokens, args.system)
        screenshot(drv, args.out, args.colours or None)
    finally:
        drv.quit()
    print(json.dumps(shown, indent=2, ensure_ascii=False))
    print(f"serve_page_shot: {args.out} ({args.out.stat().st_size // 1024} KiB)")


if __name__ == "__main__":
    main()
