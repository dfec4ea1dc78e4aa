# Set-up and the two README commands. `make demo` runs the main job, `make test` the tests;
# both create .venv and install everything on first use.
VENV ?= .venv
PY := $(VENV)/bin/python
# PyPI's torchvision imports only beside torch 2.14.1 on the CI/dev machines (see README).
TORCH_PINS ?= torch==2.14.1 torchvision==0.29.1
# Every other package pinned to a set that resolves and passes together (pip's resolver can
# otherwise backtrack for many minutes through boto3/botocore/aiobotocore versions).
CONSTRAINTS ?= constraints.txt
# Fashion-MNIST's Debian location; apt waits this long for the dpkg lock (a fresh cloud VM's
# unattended upgrades hold it for minutes) before giving up
FASHION_MNIST_DIR ?= /usr/share/datasets/fashion-mnist
APT_LOCK_TIMEOUT ?= 600
APT_GET := apt-get -o DPkg::Lock::Timeout=$(APT_LOCK_TIMEOUT)

.PHONY: setup system-deps demo-deps demo test test-fast lint docs docs-serve

$(VENV)/.installed: pyproject.toml $(CONSTRAINTS)
	python3 -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q $(TORCH_PINS)
	$(PY) -m pip install -q -c $(CONSTRAINTS) -e ".[cpu,test]"
	touch $@

# the documentation site's tools (the `docs` extra), on first `make docs`
$(VENV)/.docs-installed: $(VENV)/.installed
	$(PY) -m pip install -q -c $(CONSTRAINTS) -e ".[cpu,test,docs]"
	touch $@

setup: $(VENV)/.installed

# Fashion-MNIST (Debian package) and Chromium (renders the HTML report in a test)
system-deps:
	@if [ ! -d $(FASHION_MNIST_DIR) ] || ! command -v chromium >/dev/null; then \
	  if [ "$$(id -u)" = 0 ]; then SUDO=; else SUDO=sudo; fi; \
	  $$SUDO $(APT_GET) update -qq && DEBIAN_FRONTEND=noninteractive $$SUDO $(APT_GET) install -y -qq dataset-fashion-mnist chromium >/dev/null; \
	fi

# Only what the demo needs: Fashion-MNIST (Debian package). If it cannot be installed the demo
# still runs, on digits, and says so.
demo-deps:
	@if [ ! -d $(FASHION_MNIST_DIR) ]; then \
	  if [ "$$(id -u)" = 0 ]; then SUDO=; else SUDO=sudo; fi; \
	  ( $$SUDO $(APT_GET) update -qq && DEBIAN_FRONTEND=noninteractive $$SUDO $(APT_GET) install -y -qq dataset-fashion-mnist >/dev/null ) \
	    || echo "make demo: could not install dataset-fashion-mnist; the demo falls back to digits"; \
	fi

demo: setup demo-deps
	$(VENV)/bin/featcache demo

# one pytest worker per core (pytest-xdist), each test file whole on one worker so module
# fixtures are built once; TEST_WORKERS=0 runs them in this process
TEST_WORKERS ?= auto
test: setup system-deps
	$(PY) -m pytest -q -n $(TEST_WORKERS) --dist loadfile --no-loadscope-reorder

# the tier for iterating: everything not marked `slow` (no session stores extracted, no
# torchrun/Dask/moto/Chromium/kill -9 subprocesses), the same workers; `make test` runs it all
test-fast: setup system-deps
	$(PY) -m pytest -q -n $(TEST_WORKERS) --dist loadfile --no-loadscope-reorder -m "not slow"

# pyright (basic mode, settings in pyproject's [tool.pyright]) finds `import featcache.x` only through a
# folder named featcache; a clone may be named otherwise, so it runs in a temporary folder holding a
# link named featcache to this checkout and a pyrightconfig.json that extends the pyproject table
lint: setup
	$(VENV)/bin/ruff check .
	$(VENV)/bin/ruff format --check .
	@d=$$(mktemp -d) && ln -s "$(CURDIR)" "$$d/featcache" \
	  && echo '{"extends": "featcache/pyproject.toml"}' > "$$d/pyrightconfig.json" \
	  && (cd "$$d" && "$(abspath $(VENV))/bin/pyright" --pythonpath "$(abspath $(PY))"); \
	  rc=$$?; rm -f "$$d/featcache" "$$d/pyrightconfig.json"; rmdir "$$d"; exit $$rc

# the MkDocs site (docs/, mkdocs.yml) into site/; --strict turns every warning into an error
docs: $(VENV)/.docs-installed
	NO_MKDOCS_2_WARNING=1 $(VENV)/bin/mkdocs build --strict

docs-serve: $(VENV)/.docs-installed
	NO_MKDOCS_2_WARNING=1 $(VENV)/bin/mkdocs serve
