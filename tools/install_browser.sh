#!/usr/bin/env bash
# Chromium for tests/test_widgets_browser.py (the notebooks' widgets in a real browser, driven by playwright).
# Installs Debian's `chromium` with apt-get when run as root; otherwise says why that test will be skipped.
# Never fails the command it is part of: without a browser that test is skipped, with the reason.
for exe in "${MMRGRPO_CHROMIUM:-}" chromium chromium-browser google-chrome google-chrome-stable; do
    if [ -n "$exe" ] && command -v "$exe" >/dev/null 2>&1; then
        echo "install_browser: using $(command -v "$exe") for the browser test"; exit 0
    fi
done
if [ "$(id -u)" != 0 ] || ! command -v apt-get >/dev/null 2>&1; then
    echo "install_browser: no Chromium, and not root with apt-get: tests/test_widgets_browser.py will be skipped" \
         "(install chromium, or set MMRGRPO_CHROMIUM to a Chromium/Chrome executable)"
    exit 0
fi
echo "install_browser: apt-get install chromium (Debian's package; playwright's own browser downloads are not used)"
if apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends chromium fonts-liberation >/dev/null \
   && command -v chromium >/dev/null 2>&1; then
    echo "install_browser: installed $(chromium --version 2>/dev/null | head -n 1)"
else
    echo "install_browser: could not install chromium with apt-get: tests/test_widgets_browser.py will be skipped"
fi
exit 0
