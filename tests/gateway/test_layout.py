"""The gateway speaks the protocol without loading model code."""

import subprocess
import sys

MODEL_CODE = ("workers.engine.llama", "workers.engine.engine", "transformers")


def test_importing_the_gateway_loads_no_engine():
    code = (
        "import sys, gateway.app\n"
        f"loaded = [m for m in {MODEL_CODE!r} if m in sys.modules]\n"
        "print(','.join(loaded))\n"
    )
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert proc.stdout.strip() == "", f"importing gateway.app loaded {proc.stdout.strip()}"
