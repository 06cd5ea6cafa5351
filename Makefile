# Two front doors: `make demo` runs the main job, `make test` runs the whole suite; `make docs`
# builds the documentation site into site/ (warnings are errors).
# Each creates .venv and installs the project into it on first use.
PY := .venv/bin/python
STAMP := .venv/.installed

.PHONY: demo test docs venv gpu-check
venv: $(STAMP)

$(STAMP): pyproject.toml constraints.txt
	python3 -m venv .venv
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q -c constraints.txt -e '.[mpi,test,examples,checkpoint,yaml,docs]'
	touch $(STAMP)

demo: $(STAMP)
	$(PY) examples/demo.py

test: $(STAMP)
	$(PY) -m pytest -q -n auto --dist loadgroup

docs: $(STAMP)
	$(PY) -m mkdocs build --strict --site-dir site

# The CUDA exactness subset and the DistConv2d / split-conv timings on one GPU (no venv needed:
# any python3 with torch; writes benchmarks/results/gpu/).
gpu-check:
	PYTHONPATH=$(CURDIR)$${PYTHONPATH:+:$$PYTHONPATH} python3 benchmarks/gpu_check.py
