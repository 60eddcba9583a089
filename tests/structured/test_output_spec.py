import json

from pdserve.server.structured.output_spec import spec_problem
from pdserve.v1 import generation_pb2 as gen_pb


def test_valid_specs_pass():
    for spec in [
        gen_pb.StructuredOutput(json_object=True),
        gen_pb.StructuredOutput(json_schema=json.dumps({"type": "object", "properties": {"a": {"type": "integer"}}})),
        gen_pb.StructuredOutput(regex="[a-z]+"),
        gen_pb.StructuredOutput(choice=gen_pb.Choices(choices=["yes", "no"])),
        gen_pb.StructuredOutput(grammar='root ::= "a" | "b"'),
        gen_pb.StructuredOutput(structural_tag=json.dumps(
            {"structures": [{"begin": "<f=a>", "schema": {"type": "object"}, "end": "</f>"}], "triggers": ["<f="]})),
    ]:
        assert spec_problem(spec) is None, spec


def test_problems_name_the_field():
    cases = {
        "structured.regex: ": gen_pb.StructuredOutput(regex="(ab"),
        "structured.json_schema: Invalid type: foo": gen_pb.StructuredOutput(json_schema='{"type": "foo"}'),
        "structured.json_schema: not valid JSON": gen_pb.StructuredOutput(json_schema="[1"),
        "structured.json_schema: a JSON schema is an object": gen_pb.StructuredOutput(json_schema="[1]"),
        "structured.json_schema: Unknown format: zzz": gen_pb.StructuredOutput(
            json_schema='{"type": "string", "format": "zzz"}'),
        "structured.choice: 1 to 1024 non-empty strings": gen_pb.StructuredOutput(choice=gen_pb.Choices()),
        "structured.structural_tag.structures[0]: its begin": gen_pb.StructuredOutput(structural_tag=json.dumps(
            {"structures": [{"begin": "<g>", "schema": {}, "end": ""}], "triggers": ["<f"]})),
    }
    for start, spec in cases.items():
        problem = spec_problem(spec)
        assert problem is not None and problem.startswith(start), (start, problem)
    assert spec_problem(gen_pb.StructuredOutput(regex="(ab"), "response_format").startswith("response_format.regex")
