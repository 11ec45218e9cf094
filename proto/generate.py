"""Regenerate specsplit/v1 Python code: `python proto/generate.py` (needs grpcio-tools==1.84.0).

Generated modules land in proto/v1/ (import `specsplit.proto.v1`). grpcio-tools is pinned to the oldest grpcio the
project supports, because generated code refuses to load under a grpcio older than the one that generated it.
"""

import pathlib
import re
import shutil
import tempfile

from grpc_tools import protoc

ROOT = pathlib.Path(__file__).parent
OUT = ROOT / "v1"


def main() -> None:
    sources = sorted(str(p.relative_to(ROOT)) for p in (ROOT / "specsplit" / "v1").glob("*.proto"))
    with tempfile.TemporaryDirectory() as tmp:
        args = ["protoc", f"-I{ROOT}", f"--python_out={tmp}", f"--pyi_out={tmp}", f"--grpc_python_out={tmp}", *sources]
        if protoc.main(args) != 0:
            raise SystemExit("protoc failed")
        for generated in (pathlib.Path(tmp) / "specsplit" / "v1").iterdir():
            text = generated.read_text()
            # Generated imports name the proto package; our Python package is specsplit.proto.v1.
            text = re.sub(r"^from specsplit\.v1 import", "from specsplit.proto.v1 import", text, flags=re.M)
            (OUT / generated.name).write_text(text)
    print(f"generated {len(sources)} protos into {OUT}")


if __name__ == "__main__":
    main()
