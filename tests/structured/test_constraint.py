import asyncio

import pytest
from pdserve.server.structured.bitmask import allowed_ids, clear_from, unconstrained, words
from pdserve.server.structured.output_spec import SpecError
from pdserve.v1 import generation_pb2 as gen_pb

from tests.structured.vocab import EOS, WIDTH, grammars


def allowed(constraint) -> list[int]:
    row = unconstrained(1, WIDTH)[0]
    constraint.fill(row)
    return allowed_ids(row, WIDTH)


def test_bitmask_words_and_padding():
    assert words(40) == 2 and words(64) == 2 and words(65) == 3
    row = unconstrained(1, 70)[0]
    clear_from(row, 33)
    assert allowed_ids(row, 70) == list(range(33))
    row = unconstrained(1, 70)[0]
    clear_from(row, 32)
    assert allowed_ids(row, 70) == list(range(32))
    assert row.tolist() == [-1, 0, 0]


def test_regex_allows_exact_ids_at_each_step():
    c = grammars().constraint(gen_pb.StructuredOutput(regex="(ab)+x"))
    steps = []
    for token in [3, 1, 2, 9]:  # "ab", "a", "b", "x"
        steps.append(allowed(c))
        assert c.advance(token)
    assert steps == [[3], [1, 3, 9], [2], [1, 3, 9]]
    assert c.done and allowed(c) == [EOS]


def test_json_object_is_compact():
    c = grammars().constraint(gen_pb.StructuredOutput(json_object=True))
    assert allowed(c) == [4]  # "{" only: no whitespace before it
    c.advance(4)
    assert allowed(c) == [5, 6]  # "}" or a key's '"'
    c.advance(5)
    assert c.done and allowed(c) == [EOS]


def test_choice_and_grammar():
    g = grammars()
    c = g.constraint(gen_pb.StructuredOutput(choice=gen_pb.Choices(choices=["ab", "x"])))
    assert allowed(c) == [1, 3, 9]
    c.advance(9)
    assert c.done
    c = g.constraint(gen_pb.StructuredOutput(grammar='root ::= "a" "b"* "x"'))
    assert allowed(c) == [1, 3]
    c.advance(1)
    assert allowed(c) == [2, 9]


def test_a_token_the_grammar_refuses_puts_it_in_error():
    c = grammars().constraint(gen_pb.StructuredOutput(regex="ab"))
    assert not c.advance(9)
    assert c.error


def test_replay_resumes_where_the_outputs_left_off():
    g = grammars()
    spec = gen_pb.StructuredOutput(regex="(ab)+x")
    c = g.constraint(spec)
    c.replay([3, 1])
    assert allowed(c) == [2]
    with pytest.raises(ValueError, match="do not fit the grammar"):
        g.constraint(spec).replay([9])


def test_compiled_once_per_grammar_and_each_sequence_its_own_state():
    g = grammars()
    spec = gen_pb.StructuredOutput(regex="(ab)+x")
    assert not g.is_cached(spec)
    asyncio.run(g.prepare(spec))
    assert g.is_cached(spec)
    first, second = g.constraint(spec), g.constraint(spec)
    first.advance(3)
    assert allowed(first) == [1, 3, 9] and allowed(second) == [3]
    assert g.compiled(spec) is g.compiled(spec)


def test_a_bad_spec_is_refused_naming_the_field():
    g = grammars()
    with pytest.raises(SpecError, match=r"^sampling\.structured\.regex: .*unclosed group"):
        asyncio.run(g.prepare(gen_pb.StructuredOutput(regex="(ab")))
    with pytest.raises(SpecError, match=r"^sampling\.structured\.json_schema: Invalid type: foo"):
        g.constraint(gen_pb.StructuredOutput(json_schema='{"type": "foo"}'))


def test_no_spec_no_constraint():
    assert grammars().constraint(gen_pb.StructuredOutput()) is None


def test_warm_builds_the_tokenizer_off_the_caller():
    g = grammars()
    g.warm().join(30)
    assert g._tokenizer is not None and g._num_tokens == 10


def test_a_structural_tag_holds_the_text_after_its_trigger_to_its_schema(tiny_model):
    import json

    from pdserve.server.model.config import load_config
    from pdserve.server.model.tokenizer import Tokenizer
    from pdserve.server.structured.grammars import Grammars

    path = tiny_model("llama")
    config = load_config(path)
    tok = Tokenizer.from_dir(path)
    g = Grammars.for_model(path, config.vocab_size, tuple(config.eos_token_ids))
    tag = {"structures": [{"begin": "<f=a>", "schema": {"type": "object", "properties": {"n": {"type": "integer"}},
                                                        "required": ["n"], "additionalProperties": False},
                           "end": "</f>"}], "triggers": ["<f="]}
    c = g.constraint(gen_pb.StructuredOutput(structural_tag=json.dumps(tag)))
    row = unconstrained(1, config.vocab_size)[0]
    c.fill(row)
    assert len(allowed_ids(row, config.vocab_size)) > config.vocab_size // 2  # free text before the trigger
    c.replay(tok.encode("hi <f=a>"))
    c.fill(row)
    texts = {tok.decode([i]) for i in allowed_ids(row, config.vocab_size)}
    assert texts and all('{"n":'.startswith(t) for t in texts), texts  # the schema's object, compact
