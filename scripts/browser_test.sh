#!/usr/bin/env bash
# The real-browser test of hf-scratch-demo, in one command: installs Debian's Chromium (needs root or sudo) and the
# Python packages (the [demo] extra, playwright), then runs tests/test_demo_browser.py (marked slow, so CI's default
# run leaves it out). Playwright drives /usr/bin/chromium: `playwright install` would download a browser.
#
#   scripts/browser_test.sh                                   # the session's tiny trained model
#   DEMO_BROWSER_MODEL=runs/en-es DEMO_SCREENSHOT_DIR=docs/images scripts/browser_test.sh
#
# Extra arguments go to pytest (e.g. -s). Screenshots: demo.png (the page) and heatmap.png, in DEMO_SCREENSHOT_DIR.
set -euo pipefail
cd "$(dirname "$0")/.."
if [ ! -x /usr/bin/chromium ]; then
    if [ "$(id -u)" -eq 0 ]; then apt-get update && apt-get install -y chromium
    else sudo apt-get update && sudo apt-get install -y chromium; fi
fi
python -m pip install -e ".[demo]" "playwright>=1.50" "pytest>=8"
python -m pytest -m slow -p no:cacheprovider tests/test_demo_browser.py "$@"
