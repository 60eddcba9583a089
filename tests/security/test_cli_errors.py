"""Bad arguments to any `pdserve` command end in one line naming the problem and a non-zero exit,
never a traceback."""

from __future__ import annotations

import sys

import pytest

from pdserve.server.cli import main


def _run(capsys, *args: str) -> tuple[int, str]:
    """(exit code, stderr) of `pdserve ARGS`; an exception other than SystemExit (a traceback) fails the test."""
    try:
        code = main(list(args))
    except SystemExit as e:
        code = e.code if isinstance(e.code, int) else 1
        if isinstance(e.code, str):
            print(e.code, file=sys.stderr)
    return code, capsys.readouterr().err


@pytest.fixture(scope="module")
def model(tiny_model) -> str:
    return str(tiny_model("llama"))


@pytest.fixture(scope="module")
def short_secret(tmp_path_factory) -> str:
    path = tmp_path_factory.mktemp("secret") / "short"
    path.write_text("abc\n")
    return str(path)


def test_bad_arguments_get_a_message_not_a_traceback(model, short_secret, tmp_path, capsys):
    cases = [
        (("coordinator", "--model", model, "--port", "99999"), "port must lie in [0, 65535], got 99999"),
        (("coordinator", "--model", model, "--stall-timeout", "0"), "--stall-timeout must be > 0, got 0.0"),
        (("coordinator", "--model", model, "--max-prompt-bytes", "-1"), "--max-prompt-bytes must be > 0, got -1"),
        (("coordinator", "--model", model, "--prefill", "nohost"), "is not HOST:PORT"),
        (("coordinator", "--model", model, "--cluster-secret-file", str(tmp_path / "none")),
         "--cluster-secret-file"),
        (("coordinator", "--model", model, "--cluster-secret-file", short_secret), "use at least 16"),
        (("coordinator", "--model", model, "--tls-cert", str(tmp_path / "none.pem")), "--tls-cert and --tls-key go together"),
        (("decode", "--model", model, "--block-size", "3"), "--block-size must be a power of two, got 3"),
        (("decode", "--model", model, "--max-running", "0"), "--max-running must be >= 1, got 0"),
        (("decode", "--model", model, "--max-queue", "-1"), "--max-queue must be >= 0, got -1"),
        (("decode", "--model", model, "--max-model-len", "100000"),
         "--max-model-len 100000 exceeds the model's max_model_len 512"),
        (("coordinator", "--model", model, "--max-model-len", "-1"), "--max-model-len must be >= 1, got -1"),
        (("prefill", "--model", model, "--max-batch-size", "0"), "--max-batch-size must be >= 1, got 0"),
        (("prefill", "--model", str(tmp_path / "missing")), "cannot serve"),
        (("generate", "--token-ids", "1,x"), "--token-ids must be comma-separated integers"),
        (("status", "--cluster-secret-file", short_secret), "use at least 16"),
        (("up", "--model", model, "--decode-workers", "0"), "--decode-workers >= 1"),
        (("up", "--model", model, "--stall-timeout", "-1"), "--stall-timeout must be > 0"),
        (("up", "--model", model, "--decode-python", str(tmp_path / "none")), "--decode-python"),
        (("up", "--model", model, "--max-model-len", "100000"),
         "--max-model-len 100000 exceeds the model's max_model_len 512"),
    ]
    for args, words in cases:
        code, stderr = _run(capsys, *args)
        assert code != 0 and words in stderr, (args, code, stderr)
