"""The tokenizer loaded from a tiny checkpoint's tokenizer.json and tokenizer_config.json."""

from __future__ import annotations

import json
import shutil

import pytest

from pdserve.server.model.config import ModelLoadError
from pdserve.server.model.tokenizer import Tokenizer

EOS, BOS = 0, 1  # the tiny tokenizer's <|endoftext|> and <|begin_of_text|>


@pytest.fixture(scope="module")
def model_dir(tiny_model):
    return tiny_model("llama")


def copy_with(model_dir, tmp_path, **tokenizer_config):
    out = tmp_path / "model"
    shutil.copytree(model_dir, out, ignore=shutil.ignore_patterns("*.safetensors"))
    path = out / "tokenizer_config.json"
    path.write_text(json.dumps({**json.loads(path.read_text()), **tokenizer_config}))
    return out


def test_loads_ids_and_special_tokens(model_dir):
    tok = Tokenizer.from_dir(model_dir)
    assert tok.vocab_size == 512
    assert tok.eos_token_ids == (EOS,)
    assert tok.bos_token_id == BOS
    assert tok.add_bos_token is False
    assert tok.token_to_id("<|endoftext|>") == EOS


@pytest.mark.parametrize("text", ["import os\n", "你好，世界！", "emoji 😀🎉 and héllo", "  spaces  \t"])
def test_encode_decode_round_trip(model_dir, text):
    tok = Tokenizer.from_dir(model_dir)
    ids = tok.encode(text)
    assert ids and BOS not in ids
    assert all(0 <= i < tok.vocab_size for i in ids)
    assert tok.decode(ids) == text


def test_exact_ids_for_bytes(model_dir):
    # Ids 2..257 are the byte alphabet (in the ByteLevel order), whatever the BPE merges learnt.
    tok = Tokenizer.from_dir(model_dir)
    assert tok.encode("😀") == [174, 255, 248, 224]
    assert tok.encode("a") == [66]


def test_decode_skips_special_tokens_unless_asked(model_dir):
    tok = Tokenizer.from_dir(model_dir)
    ids = [BOS, *tok.encode("hi"), EOS]
    assert tok.decode(ids) == "hi"
    assert tok.decode(ids, skip_special_tokens=False) == "<|begin_of_text|>hi<|endoftext|>"


def test_bos_is_added_only_when_the_config_says_so(model_dir, tmp_path):
    tok = Tokenizer.from_dir(copy_with(model_dir, tmp_path, add_bos_token=True))
    plain = Tokenizer.from_dir(model_dir).encode("hi")
    assert tok.encode("hi") == [BOS, *plain]
    assert tok.decode(tok.encode("hi")) == "hi"


def test_special_tokens_given_as_objects(model_dir, tmp_path):
    tok = Tokenizer.from_dir(copy_with(model_dir, tmp_path, eos_token={"content": "<|endoftext|>"}))
    assert tok.eos_token_ids == (EOS,)


def test_missing_tokenizer_json_is_a_clear_error(model_dir, tmp_path):
    out = copy_with(model_dir, tmp_path)
    (out / "tokenizer.json").unlink()
    with pytest.raises(ModelLoadError, match=r"tokenizer\.json is missing"):
        Tokenizer.from_dir(out)


def test_corrupt_tokenizer_json_is_a_clear_error(model_dir, tmp_path):
    out = copy_with(model_dir, tmp_path)
    (out / "tokenizer.json").write_text('{"version": "1.0", "model": 3')
    with pytest.raises(ModelLoadError, match=r"tokenizer\.json is not a valid tokenizer\.json"):
        Tokenizer.from_dir(out)


def test_corrupt_tokenizer_config_is_a_clear_error(model_dir, tmp_path):
    out = copy_with(model_dir, tmp_path)
    (out / "tokenizer_config.json").write_text("{nope")
    with pytest.raises(ModelLoadError, match=r"tokenizer_config\.json is not valid JSON"):
        Tokenizer.from_dir(out)


def test_add_bos_without_a_bos_token_is_refused(model_dir, tmp_path):
    out = copy_with(model_dir, tmp_path, add_bos_token=True, bos_token=None)
    (out / "generation_config.json").unlink()
    with pytest.raises(ModelLoadError, match="no BOS token"):
        Tokenizer.from_dir(out)
