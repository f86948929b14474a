#!/usr/bin/env bash
# Prepare, on a machine with the registries, what a lent TPU machine (no network, jax + libtpu preinstalled)
# needs to run the project's engine: the project's pinned wheels in .whl-tpu/ (git-ignored) and the
# runner. Then one device call: `bash .whl-tpu/run.sh` with .whl-tpu carried (docs/development.md: On a TPU machine).
set -euo pipefail
cd "$(dirname "$0")/.."
grep -qx '/.whl-tpu/' .git/info/exclude 2>/dev/null || echo /.whl-tpu/ >> .git/info/exclude
mkdir -p .whl-tpu
pins=$(.venv/bin/python -m pip list --format=freeze 2>/dev/null | sed 's/-/_/g' | grep -iE '^(gguf|llguidance|starlette|uvicorn|pydantic|pydantic_core|annotated_types|typing_inspection|prometheus_client|opentelemetry_api|opentelemetry_sdk|opentelemetry_semantic_conventions|httpx|httpcore|h11|anyio|idna|certifi)==')
python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.11 --implementation cp \
  --platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64 --platform manylinux_2_17_x86_64 \
  --platform manylinux2014_x86_64 --platform manylinux_2_31_x86_64 -d .whl-tpu $pins
cat > .whl-tpu/run.sh <<'RUN'
#!/usr/bin/env bash
# On the TPU machine: install (the machine's own index for flax/transformers/..., the carried wheels for
# the rest, under /tmp: commands run as an ordinary user), then the TPU benchmark into $OUT.
cd "$(dirname "$0")/.."
if [ ! -d /tmp/site2 ]; then
  PIP_CONFIG_FILE=/dev/null python3 -m pip install --isolated -q --only-binary=:all: --index-url file:///opt/pypi/simple \
    --target /tmp/site flax transformers tokenizers safetensors sentencepiece jinja2 pyyaml ml_dtypes >/dev/null 2>&1
  PIP_CONFIG_FILE=/dev/null python3 -m pip install --isolated -q --no-index --no-deps --no-compile --no-cache-dir \
    --upgrade --target /tmp/site2 .whl-tpu/*.whl >/dev/null 2>&1
fi
export PYTHONPATH=$PYTHONPATH:/tmp/site:/tmp/site2:$PWD/service PYTHONUNBUFFERED=1
python3 benchmarks/tpu_bench.py --out-dir "${OUT:-results}/bench" "$@" 2>&1 | grep -v 'UserWarning\|warnings.warn'
RUN
chmod +x .whl-tpu/run.sh
ls .whl-tpu | wc -l
