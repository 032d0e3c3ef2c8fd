"""The committed gRPC stubs are what `python -m proto.generate` makes from the .proto now."""

import re
from pathlib import Path

from proto import generate

# lines naming the generator's versions, which may differ between machines
VERSION_LINE = re.compile(r"^(# Protobuf Python Version:|GRPC_GENERATED_VERSION =).*$", re.M)
RUNTIME_CHECK = re.compile(r"_runtime_version\.ValidateProtobufRuntimeVersion\([^)]*\)")


def normalised(path: Path) -> str:
    return RUNTIME_CHECK.sub("", VERSION_LINE.sub("", path.read_text()))


def test_committed_stubs_are_up_to_date(tmp_path):
    for fresh in generate.generate(tmp_path):
        committed = generate.ROOT / fresh.relative_to(tmp_path)
        assert committed.exists(), f"{committed} is missing: run `make proto`"
        assert normalised(committed) == normalised(fresh), (
            f"{committed.relative_to(generate.ROOT)} is stale: run `make proto` and commit it"
        )


def test_stubs_import_as_a_package():
    from proto.specsplit.v1 import specsplit_pb2, specsplit_pb2_grpc

    assert specsplit_pb2.DESCRIPTOR.package == "specsplit.v1"
    assert {"DraftService", "TargetService"} <= set(specsplit_pb2.DESCRIPTOR.services_by_name)
    assert hasattr(specsplit_pb2_grpc, "TargetServiceStub")
