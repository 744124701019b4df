"""hf-scratch-demo in a real browser (slow; `scripts/browser_test.sh` installs what it needs and runs it): Debian's
Chromium, headless, driven by Playwright, types a sentence, clicks Translate, reads the translation and its
confidence, hovers a cell of the heatmap for its weight, switches layer and head, saves screenshots, then pastes a
glossary, ticks protection and translates a string with markup and a placeholder.

    DEMO_BROWSER_MODEL=DIR        a model to show (default: the session's tiny trained model)
    DEMO_BROWSER_SENTENCE=TEXT    the sentence typed (default: a sentence that model learnt)
    DEMO_SCREENSHOT_DIR=DIR       where demo.png (the page) and heatmap.png go (default: the test's tmp folder)
"""

import os
import subprocess
import sys
from pathlib import Path

import pytest
from test_demo import REPO, SENTENCE, _free_port, _wait_for_page

from hf_scratch_transformer.protected_spans import tokenizer_has_sentinels
from hf_scratch_transformer.translation import demo
from hf_scratch_transformer.translation.translate import load_model_and_tokenizer

pytestmark = pytest.mark.slow
CHROMIUM = Path("/usr/bin/chromium")
CHROMIUM_ARGS = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
                 "--disable-background-networking", "--disable-component-update", "--disable-sync"]


@pytest.fixture
def served_demo(trained_model_dir):
    """(page URL, model directory, sentence) of the demo running in a subprocess on 127.0.0.1."""
    pytest.importorskip("gradio", reason="the demo needs gradio: pip install -e '.[demo]'")
    model = os.environ.get("DEMO_BROWSER_MODEL", str(trained_model_dir))
    port = _free_port()
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")])}
    process = subprocess.Popen([sys.executable, "-m", "hf_scratch_transformer.translation.demo", "--model", model, "--port",
                                str(port)], env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    try:
        _wait_for_page(f"http://127.0.0.1:{port}/", process)
        yield f"http://127.0.0.1:{port}/", model, os.environ.get("DEMO_BROWSER_SENTENCE", SENTENCE)
    finally:
        process.terminate()
        process.wait(timeout=30)


def _tooltip(page) -> dict[str, str]:
    """The rows of vega-tooltip's box: {"generated token": ..., "source token": ..., "attention": ...}."""
    box = page.locator("#vg-tooltip-element")
    box.wait_for(state="visible", timeout=10_000)
    keys = box.locator("td.key").all_inner_texts()
    values = box.locator("td.value").all_inner_texts()
    return {key.rstrip(":").strip(): value.strip() for key, value in zip(keys, values)}


def test_a_person_translates_and_explores_the_attention_in_chromium(served_demo, tmp_path):
    sync_api = pytest.importorskip("playwright.sync_api", reason="pip install playwright (scripts/browser_test.sh)")
    if not CHROMIUM.exists():
        pytest.skip("Debian's Chromium is not installed: apt-get install chromium (scripts/browser_test.sh)")
    url, model_dir, sentence = served_demo
    screenshots = Path(os.environ.get("DEMO_SCREENSHOT_DIR", tmp_path))
    screenshots.mkdir(parents=True, exist_ok=True)
    # as the served demo loads it (its --dtype auto: int8 or bf16 products on some CPUs), so that its scores match
    model, tokenizer = load_model_and_tokenizer(model_dir, dtype="auto")
    beams = demo.default_beams(model)  # the page's settings at start: beam search, n-best of min(3, beams)
    protect = tokenizer_has_sentinels(tokenizer)  # the toggle's state at start
    shown = demo.translate_text(model, tokenizer, sentence, num_beams=beams, num_hypotheses=min(3, beams),
                                protect=protect)
    best = shown.hypotheses[0]
    view = demo.attention_view(model, tokenizer, *demo.first_sentence(shown))
    requests = []
    with sync_api.sync_playwright() as playwright:
        browser = playwright.chromium.launch(executable_path=str(CHROMIUM), args=CHROMIUM_ARGS, headless=True)
        page = browser.new_page(viewport={"width": 1300, "height": 1000})
        page.on("request", lambda request: requests.append(request.url))
        page.goto(url)
        page.locator("#source textarea").fill(sentence)
        page.locator("#translate").click()
        page.wait_for_function("document.querySelector('#translation textarea').value.length > 0", timeout=120_000)
        assert page.locator("#translation textarea").input_value() == best.text
        assert page.locator("#confidence textarea").input_value() == demo.text_report(shown)
        heatmap, chart = page.locator("#heatmap"), page.locator("#heatmap svg.marks")  # Vega draws in SVG
        cells = chart.locator(".mark-rect.role-mark path")  # one per cell, in the data's order (row by row)
        cells.first.wait_for(timeout=30_000)
        assert cells.count() == view.weights.shape[2] * view.weights.shape[3]
        assert demo.heatmap_title(view.weights, None, None) in chart.text_content()

        cells.first.hover()  # the first generated token × the first source token
        first_cell = demo.heatmap_matrix(view.weights)[0, 0]
        assert _tooltip(page) == {"generated token": view.target_labels[0], "source token": view.source_labels[0],
                                  "attention": f"{first_cell:.3f}"}
        page.screenshot(path=str(screenshots / "demo.png"), full_page=True)
        heatmap.screenshot(path=str(screenshots / "heatmap.png"))

        page.locator("#head input").click()
        page.get_by_role("option", name="head 2", exact=True).click()
        title = demo.heatmap_title(view.weights, None, 1)  # "..., head 2 of H"
        page.wait_for_function(f"document.querySelector('#heatmap svg.marks').textContent.includes({title!r})",
                               timeout=30_000)

        # a glossary pasted into its field, a placeholder and markup with protection ticked
        text, terms = "God is love, <b>%d</b> times.", "God\tDios\nlove\tamor"
        pinned = demo.translate_text(model, tokenizer, text, num_beams=beams, num_hypotheses=min(3, beams),
                                     protect=True, glossary=terms)
        page.locator("#source textarea").fill(text)
        page.locator("#glossary textarea").fill(terms)
        page.locator("#protect input").set_checked(True)
        page.locator("#translate").click()
        page.wait_for_function(f"document.querySelector('#translation textarea').value === {pinned.text!r}",
                               timeout=120_000)
        assert page.locator("#confidence textarea").input_value() == demo.text_report(pinned)
        assert "glossary: 2 of 2 term occurrence(s) honoured" in demo.text_report(pinned)
        assert all(pinned.text.count(span) == 1 for span in ("<b>", "%d", "</b>"))
        browser.close()
    outside = sorted({request for request in requests if not request.startswith(url)})
    assert not outside, f"the page fetched from elsewhere: {outside[:5]}"
