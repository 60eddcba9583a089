"""The generated protobuf code under proto/ is what `make proto` makes from the .proto files now."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def test_generated_code_is_fresh(tmp_path):
    protos = sorted((ROOT / "proto" / "pdserve" / "v1").glob("*.proto"))
    subprocess.run(
        [sys.executable, "-m", "grpc_tools.protoc", f"-I{ROOT / 'proto'}", f"--python_out={tmp_path}",
         f"--pyi_out={tmp_path}", f"--grpc_python_out={tmp_path}", *map(str, protos)],
        check=True,
    )
    generated = sorted((tmp_path / "pdserve" / "v1").glob("*.py*"))
    assert generated, "protoc produced nothing"
    stale = [g.name for g in generated if g.read_bytes() != (ROOT / "proto" / "pdserve" / "v1" / g.name).read_bytes()]
    assert not stale, f"generated code is stale: run `make proto` and commit ({', '.join(stale)})"
