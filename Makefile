# modalign: two commands on a fresh machine.
#   make demo   install what is missing, generate a sample session, run the pipeline on a local Ray
#   make test   install what is missing, run the test suite (what CI runs)
# Both are idempotent: a second run only re-checks the stamps (seconds).

PYTHON  ?= python3.11
VENV    ?= .venv
BIN     := $(VENV)/bin
APT_PKGS := tesseract-ocr tesseract-ocr-eng poppler-utils espeak-ng wamerican
# tests of HTML a person reads (access reports, run reports): a real headless browser
TEST_APT_PKGS := chromium chromium-driver
# deid-eval and its tests only: more voices, real videos with faces, real manuals (text precision)
EVAL_APT_PKGS := flite pocketsphinx-testdata alsa-utils opencv-doc fonts-dejavu-core fonts-liberation quilt cvs libtasn1-doc pstoedit blktrace xmlformat-doc debdelta-doc purifyeps \
                 pssh tig srf-doc coccinelle-doc shared-mime-info
EVAL_FILES := /usr/bin/flite /usr/share/pocketsphinx/test/data /usr/share/sounds/alsa/Front_Center.wav /usr/share/doc/opencv-doc/examples/data/vtest.avi /usr/share/doc/quilt/quilt.pdf \
              /usr/share/fonts/truetype/liberation/LiberationSerif-Regular.ttf /usr/share/fonts/truetype/dejavu/DejaVuSansMono.ttf \
              /usr/share/doc/coccinelle/manual.pdf /usr/share/doc/srf-doc/SRF_v_1_3_2_June_19th_2008-0001.pdf \
              /usr/share/doc/shared-mime-info/shared-mime-info-spec.pdf /usr/share/doc/pssh/pssh-HOWTO.pdf
SUDO    := $(shell [ "$$(id -u)" = 0 ] || echo sudo)
LOCK    := $(shell cat pyproject.toml requirements/no-deps.txt | sha256sum | cut -c1-12)
STAMP   := $(VENV)/.installed-$(LOCK)
DURATION ?= 12
PYTEST_ARGS ?=

.PHONY: setup system-deps demo test test-unit bench clean

setup: system-deps $(STAMP)
	@# modalign's own bytecode, as a wheel install has it: every Ray worker imports these modules, and
	@# where PYTHONDONTWRITEBYTECODE is set (containers, CI) each process would compile them again
	@$(BIN)/python -m compileall -q -j0 operators pipeline schemas __init__.py >/dev/null

system-deps:
	@if ! command -v tesseract >/dev/null || ! tesseract --list-langs 2>/dev/null | grep -qx eng \
	    || ! command -v pdftoppm >/dev/null || ! command -v espeak-ng >/dev/null || ! test -s /usr/share/dict/words \
	    || ! ls $(EVAL_FILES) >/dev/null 2>&1 || ! command -v chromium >/dev/null || ! command -v chromedriver >/dev/null; then \
	  echo "installing Debian packages: $(APT_PKGS) $(TEST_APT_PKGS) $(EVAL_APT_PKGS)"; \
	  $(SUDO) apt-get update -qq && DEBIAN_FRONTEND=noninteractive $(SUDO) apt-get install -y -qq --no-install-recommends \
	    $(APT_PKGS) $(TEST_APT_PKGS) $(EVAL_APT_PKGS); \
	fi

$(STAMP): pyproject.toml requirements/no-deps.txt
	@test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip
	$(BIN)/pip install -q -e '.[dev,eval]'
	$(BIN)/pip install -q --no-deps -r requirements/no-deps.txt
	@rm -f $(VENV)/.installed-* && touch $@

demo: setup
	$(BIN)/modalign sample sample --duration $(DURATION)
	$(BIN)/modalign run sample/manifest.yaml --out out

test: setup
	$(BIN)/pytest $(PYTEST_ARGS)

test-unit: setup
	$(BIN)/pytest -m unit $(PYTEST_ARGS)

clean:
	rm -rf out sample .pytest_cache .hypothesis
