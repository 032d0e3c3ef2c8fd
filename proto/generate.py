"""Regenerates the gRPC stubs from the .proto contract: `python -m proto.generate`.

Run from anywhere; the stubs land next to the .proto (or under `--out DIR`,
which the stale-stub test uses) with imports of the form
`from proto.specsplit.v1 import specsplit_pb2`.
"""

from __future__ import annotations

import argparse
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent  # the repository root, the protoc include path
PROTOS = [Path("proto/specsplit/v1/specsplit.proto")]  # relative to ROOT
STUBS = ["specsplit_pb2.py", "specsplit_pb2_grpc.py"]


def generate(out: Path = ROOT) -> list[Path]:
    """Writes the stubs under `out` (mirroring the proto's path); returns their paths."""
    from grpc_tools import protoc

    out.mkdir(parents=True, exist_ok=True)
    for proto in PROTOS:
        args = [
            "grpc_tools.protoc",
            f"-I{ROOT}",
            f"--python_out={out}",
            f"--grpc_python_out={out}",
            str(ROOT / proto),
        ]
        if protoc.main(args) != 0:
            raise RuntimeError(f"protoc failed on {proto}")
    return [out / proto.parent / name for proto in PROTOS for name in STUBS]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=ROOT, help="root to write the stubs under")
    for path in generate(parser.parse_args().out):
        print(path)


if __name__ == "__main__":
    main()
