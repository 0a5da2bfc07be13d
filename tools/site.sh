#!/usr/bin/env bash
# The lessons as a website (docs/mkdocs.yml): build it into _site/ from the notebooks' stored outputs (nothing is
# executed), then check it in headless Chromium (tools/site_check.py): every page renders without a JavaScript error,
# no broken internal link, anchor or image, the navigation in the lesson order, search finds a word.
# Usage: bash tools/site.sh [REPO]  (default: this repository; the tests pass a small copy). Exits 1 on any problem.
set -euo pipefail
tools="$(cd "$(dirname "$0")" && pwd)"
root="$(cd "${1:-$tools/..}" && pwd)"
start=$SECONDS
echo "site: building $root/_site from docs/mkdocs.yml (mkdocs-material + mkdocs-jupyter; the notebooks are not run)"
NO_MKDOCS_2_WARNING=1 python -m mkdocs build --quiet --strict --clean -f "$root/docs/mkdocs.yml"
echo "site: built in $((SECONDS - start)) s; checking it in Chromium"
python "$tools/site_check.py" "$root/_site" --root "$root" ${MMRGRPO_SITE_SEARCH:+--search "$MMRGRPO_SITE_SEARCH"}
echo "site: built and checked in $((SECONDS - start)) s"
