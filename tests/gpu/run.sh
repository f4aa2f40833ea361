#!/usr/bin/env bash
# One device run does it all (about 3-5 minutes on an H200; the device tool's budget is 15 minutes):
#   bash tests/gpu/run.sh          (from the repository root; make gpu-wheels first, carry .whl)
# (a) installs the carried wheels in .whl/ (the GPU machine has CUDA torch, cupy and pytest but no
# registry), (b) runs the gpu tests, (c) runs `kvstrata bench --device cuda`, (d) writes
# summary.json. Everything lands in $OUT (./gpu-report when OUT is unset).
set -u
cd "$(dirname "$0")/../.."
OUT="${OUT:-$PWD/gpu-report}"
mkdir -p "$OUT"
PY="${PYTHON:-python3}"
export PYTHONUNBUFFERED=1
if compgen -G ".whl/*.whl" >/dev/null; then
  $PY -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
    >"$OUT/pip.log" 2>&1 || { echo "wheel install failed (see $OUT/pip.log)"; exit 1; }
  export PYTHONPATH="/tmp/site${PYTHONPATH:+:$PYTHONPATH}"
fi
# the repository root is the package kvstrata: import it through a link named kvstrata
mkdir -p .typecheck && ln -sfn .. .typecheck/kvstrata
export PYTHONPATH="$PWD/.typecheck:${PYTHONPATH:-}"
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv >"$OUT/nvidia-smi.csv" 2>&1 || true
$PY -c "import torch, sys; print(torch.__version__, torch.cuda.is_available(), sys.version)" >"$OUT/env.txt" 2>&1
$PY -c "import kvikio; print('kvikio', kvikio.__version__)" >>"$OUT/env.txt" 2>&1 || true

timeout 300 $PY -m pytest -m gpu tests/gpu -q -p no:cacheprovider -o addopts="" -rs --timeout 240 \
  --junitxml="$OUT/gpu-tests.xml" 2>&1 | tee "$OUT/gpu-tests.log"
tests_rc=${PIPESTATUS[0]}
timeout 180 $PY -m kvstrata bench --device cuda --json "$OUT/gpu-bench.json" 2>&1 | tee "$OUT/gpu-bench.log"
bench_rc=${PIPESTATUS[0]}

$PY - "$OUT" "$tests_rc" "$bench_rc" <<'PYEOF'
import json, sys, xml.etree.ElementTree as ET
from pathlib import Path
out, tests_rc, bench_rc = Path(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3])
summary = {"tests_rc": tests_rc, "bench_rc": bench_rc, "env": (out / "env.txt").read_text(errors="replace")}
try:
    suite = ET.parse(out / "gpu-tests.xml").getroot()
    suite = suite if suite.tag == "testsuite" else suite[0]
    summary["tests"] = {k: int(suite.get(k, 0)) for k in ("tests", "failures", "errors", "skipped")}
    summary["not_passed"] = [
        {"test": f"{c.get('classname')}::{c.get('name')}", "outcome": r.tag, "message": (r.get("message") or "")[:300]}
        for c in suite.iter("testcase") for r in c if r.tag in ("failure", "error", "skipped")
    ]
except (OSError, ET.ParseError) as exc:
    summary["tests"] = f"no junit report: {exc}"
try:
    summary["bench"] = json.loads((out / "gpu-bench.json").read_text())
except (OSError, ValueError) as exc:
    summary["bench"] = f"no bench report: {exc}"
(out / "summary.json").write_text(json.dumps(summary, indent=2))
print(json.dumps({k: v for k, v in summary.items() if k != "env"}, indent=2)[:6000])
PYEOF
exit $(( tests_rc != 0 || bench_rc != 0 ))
