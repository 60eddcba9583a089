"""The conversations `multi_turn.py` replays: a shared system prompt and histories that grow turn by turn.

Three shapes, every length in tokens and every token id drawn from a seed (same seed, same conversations):
- `synthetic`: fixed lengths: the system prompt, then each turn `--user` new tokens and an answer of `--answer`.
- `sharegpt`: ShareGPT-shaped lengths: log-normal user turns (long tail) and longer log-normal answers, as the
  human/gpt turns of ShareGPT are; or, given `--sharegpt FILE`, the token lengths of that file's own turns.
- `agentic`: a long system prompt (tool definitions), one user task, then many short turns, each a long tool
  output the model answers with a short tool call.
A conversation keeps only the turns that fit the model (prompt + answer <= max_len); it opens at a Poisson time
(`rate` conversations a second; 0: one after another), and each later turn follows the previous answer after an
exponential think time. The token ids come from real text (stdlib sources, as the embedded model was trained on)
at seeded offsets: only the system prompt is shared, so two conversations' blocks differ after it.
"""

from __future__ import annotations

import json
import textwrap
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

import numpy as np

from pdserve.server.plan.datasets import sample_lengths

Workload = Literal["synthetic", "sharegpt", "agentic"]
WORKLOADS: tuple[Workload, ...] = ("synthetic", "sharegpt", "agentic")

CORPUS_FILES = [Path(json.__file__), Path(json.__file__).with_name("decoder.py"),
                Path(json.__file__).with_name("encoder.py"), Path(textwrap.__file__)]
"""Where the token ids come from."""


@dataclass(frozen=True)
class Shape:
    """A workload's lengths (tokens; medians for the log-normal ones) and pacing."""

    workload: Workload
    system: int
    """The shared system prompt (agentic: the tool definitions)."""
    user: int
    """New user tokens a turn (agentic: the first turn's task)."""
    answer: int
    """Answer tokens a turn (max_tokens, ignore_eos)."""
    tool: int = 0
    """agentic: the tool output that opens each turn after the first."""
    think_s: float = 0.5
    """Mean think time between an answer and the next turn (exponential)."""


def default_shape(workload: Workload, max_len: int, think_s: float = 0.5) -> Shape:
    """Each workload's lengths scaled to a model of `max_len` tokens (ShareGPT's at 4,096 and above)."""
    scale = min(1.0, max_len / 4096)
    if workload == "synthetic":
        return Shape(workload, system=max(16, int(1024 * scale)), user=max(8, int(256 * scale)),
                     answer=max(8, int(384 * scale)), think_s=think_s)
    if workload == "sharegpt":  # ShareGPT's turns: human median ~120 tokens with a long tail, gpt ~250
        return Shape(workload, system=max(16, int(512 * scale)), user=max(8, int(120 * scale)),
                     answer=max(8, int(250 * scale)), think_s=think_s)
    if workload == "agentic":  # tool outputs log-normal around 256 tokens (a long tail), tool calls ~64
        return Shape(workload, system=max(16, int(1024 * scale)), user=max(8, int(256 * scale)),
                     answer=max(4, int(64 * scale)), tool=max(8, int(256 * scale)), think_s=think_s)
    raise ValueError(f"unknown workload {workload!r}: choose one of {', '.join(WORKLOADS)}")


@dataclass(frozen=True)
class Turn:
    new_ids: tuple[int, ...]
    """What the client appends after the previous answer: user text, or a tool output."""
    answer_len: int
    think_s: float
    """Seconds between the previous answer and this turn (0 for the first)."""


@dataclass(frozen=True)
class Conversation:
    index: int
    start_s: float
    """When it opens, from the run's start (rate 0: in order, one after another)."""
    system_ids: tuple[int, ...]
    turns: tuple[Turn, ...]

    def prompt_len(self, turn: int) -> int:
        """Tokens of turn `turn`'s prompt (0-based): the system prompt, every earlier turn and answer, this turn."""
        return len(self.system_ids) + sum(len(t.new_ids) + t.answer_len for t in self.turns[:turn]) + \
            len(self.turns[turn].new_ids)


def corpus(tokenizer) -> list[int]:
    """The token ids every conversation's text is cut from."""
    return tokenizer.encode("\n".join(p.read_text() for p in CORPUS_FILES))


def _lengths(shape: Shape, turns: int, rng: np.random.Generator,
             sharegpt_turns: list[tuple[int, int]] | None) -> list[tuple[int, int]]:
    """(new tokens, answer tokens) of each turn of one conversation."""
    if shape.workload == "synthetic":
        return [(shape.user, shape.answer)] * turns
    if shape.workload == "sharegpt":
        if sharegpt_turns:
            start = int(rng.integers(len(sharegpt_turns)))
            return [sharegpt_turns[(start + i) % len(sharegpt_turns)] for i in range(turns)]
        users = sample_lengths(turns, shape.user, "lognormal", rng, sigma=1.0, minimum=4)
        answers = sample_lengths(turns, shape.answer, "lognormal", rng, sigma=0.6, minimum=4)
        return list(zip(users, answers))
    tools = sample_lengths(turns - 1, shape.tool, "lognormal", rng, sigma=0.8, minimum=4)
    answers = sample_lengths(turns, shape.answer, "uniform", rng, range_ratio=0.5, minimum=2)
    return list(zip([shape.user, *tools], answers))


def build(shape: Shape, n: int, turns: int, max_len: int, ids: list[int], *, rate: float = 0.0, seed: int = 0,
          sharegpt_turns: list[tuple[int, int]] | None = None) -> list[Conversation]:
    """`n` conversations of up to `turns` turns each, every prompt + answer within `max_len` tokens."""
    if shape.system + shape.user + shape.answer > max_len:
        raise ValueError(f"the first turn ({shape.system} system + {shape.user} user + {shape.answer} answer tokens) "
                         f"exceeds the model's {max_len}: pass smaller --system/--user/--answer")
    rng = np.random.default_rng(seed)

    def cut(k: int) -> tuple[int, ...]:
        if k > len(ids):
            raise ValueError(f"a {k}-token segment is longer than the text ({len(ids)} tokens): shorter lengths")
        at = int(rng.integers(0, len(ids) - k + 1))
        return tuple(ids[at : at + k])

    system = cut(shape.system)
    gaps = rng.exponential(1.0 / rate, size=n) if rate > 0 else np.zeros(n)
    out = []
    for c, start in enumerate(np.cumsum(gaps) - gaps[0]):
        used, kept = shape.system, []
        for k, (new, answer) in enumerate(_lengths(shape, turns, rng, sharegpt_turns)):
            if used + new + answer > max_len:
                break
            think = float(rng.exponential(shape.think_s)) if k and shape.think_s > 0 else 0.0
            kept.append(Turn(cut(new), answer, think))
            used += new + answer
        out.append(Conversation(c, float(start), system, tuple(kept)))
    return out


def sharegpt_turn_lengths(path: Path, tokenizer, limit: int = 2000) -> list[tuple[int, int]]:
    """(human tokens, gpt tokens) of each human turn followed by a gpt turn in a ShareGPT JSON/JSONL file."""
    text = path.read_text(encoding="utf-8")
    convs = [json.loads(line) for line in text.splitlines() if line.strip()] if path.suffix == ".jsonl" \
        else json.loads(text)
    out = []
    for conv in convs if isinstance(convs, list) else [convs]:
        msgs = conv.get("conversations") or conv.get("conversation") or []
        for human, gpt in zip(msgs, msgs[1:]):
            if human.get("from") == "human" and gpt.get("from") == "gpt":
                out.append((len(tokenizer.encode(human.get("value", ""))), len(tokenizer.encode(gpt.get("value", "")))))
        if len(out) >= limit:
            break
    if not out:
        raise ValueError(f"{path}: no human turn followed by a gpt turn: is it ShareGPT's format "
                         "([{\"conversations\": [{\"from\": \"human\", \"value\": ...}, ...]}])?")
    return out


def new_tokens(prompt: list[int], known: list[list[int]]) -> int:
    """Tokens of `prompt` past its longest prefix shared with any known sequence (what the system has seen: earlier
    prompts, and earlier prompts followed by their answers): what is new in this turn."""
    best = 0
    for seq in known:
        n = min(len(seq), len(prompt))
        k = 0
        while k < n and seq[k] == prompt[k]:
            k += 1
        best = max(best, k)
    return len(prompt) - best
