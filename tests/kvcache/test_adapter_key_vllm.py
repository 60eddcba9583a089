"""vLLM 0.32 itself (in .venv-vllm) is the oracle of a LoRA adapter's block names: its `generate_block_hash_extra_keys`
for a request of the adapter, then `hash_block_tokens`, give the hashes pdserve's prefix caches give, and its
`to_event_extra_keys` the extra keys pdserve's BlockStored events carry."""

from __future__ import annotations

import json
import os

from pdserve.kvcache.adapter_key import AdapterKey
from pdserve.kvcache.block_hash import BlockHasher

from tests.vllm_python import require_vllm_python
from tests.vllm_scripts import run_vllm_script

require_vllm_python()

ORACLE = r"""
import json, sys, types
from vllm.lora.request import LoRARequest
from vllm.utils.hashing import get_hash_fn_by_name
from vllm.v1.core import kv_cache_utils as u

req = json.load(sys.stdin)
fn = get_hash_fn_by_name("sha256")
u.init_none_hash(fn)
request = types.SimpleNamespace(lora_request=LoRARequest(req["name"], req["id"], req["path"]), mm_features=[],
                                cache_salt=None, prompt_embeds=None)
tokens, bs, parent, chain, events = req["tokens"], req["block_size"], None, [], []
for i in range(len(tokens) // bs):
    keys, _ = u.generate_block_hash_extra_keys(request, i * bs, (i + 1) * bs, 0)
    parent = u.hash_block_tokens(fn, parent, tokens[i * bs : (i + 1) * bs], keys)
    chain.append(parent.hex())
    events.append(keys)
print("ORACLE " + json.dumps({"hashes": chain, "event_keys": u.to_event_extra_keys(events)}))
"""


def test_an_adapters_block_names_are_vllms():
    adapter = AdapterKey(3, "ada", "/adapters/ada")
    tokens, block_size = list(range(100, 112)), 4
    env = {k: v for k, v in os.environ.items() if k != "PYTHONHASHSEED"}
    request = {"name": adapter.name, "id": adapter.id, "path": adapter.path, "tokens": tokens, "block_size": block_size}
    run = run_vllm_script(code=ORACLE, stdin=json.dumps(request), env=env, timeout=300)
    line = next((l for l in run.stdout.splitlines() if l.startswith("ORACLE ")), None)
    assert line is not None, run.stderr[-3000:]
    oracle = json.loads(line.removeprefix("ORACLE "))
    hasher = BlockHasher("sha256")
    assert [h.hex() for h in hasher.hashes(tokens, block_size, extra_keys=adapter.extra_keys)] == oracle["hashes"]
    assert oracle["event_keys"] == [list(adapter.event_extra_keys)] * 3
