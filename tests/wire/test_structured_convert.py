"""structured_output crosses the wire unchanged in each of its forms."""

import pytest

from pdserve.engine.sampling.grammar import GrammarKind, StructuredOutput
from pdserve.engine.sampling.params import SamplingParams
from pdserve.protos import pdserve_pb2
from pdserve.wire.convert import sampling_from_proto, sampling_to_proto


@pytest.mark.parametrize("so", [StructuredOutput(GrammarKind.JSON_SCHEMA, '{"type": "object"}', 3),
                                StructuredOutput(GrammarKind.REGEX, "[a-z]+"),
                                StructuredOutput(GrammarKind.JSON_OBJECT), None])
def test_round_trip(so):
    params = SamplingParams(max_tokens=5, structured=so)
    wire = pdserve_pb2.SamplingParams.FromString(sampling_to_proto(params).SerializeToString())
    assert sampling_from_proto(wire) == params


def test_an_empty_constraint_is_none():
    p = pdserve_pb2.SamplingParams(structured_output=pdserve_pb2.StructuredOutput(json_object=False))
    assert sampling_from_proto(p).structured is None
