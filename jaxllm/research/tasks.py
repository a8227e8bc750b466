"""Checkable prompts generated in code: arithmetic, copying, JSON extraction, counted lists.

Each `Task` carries its chat messages and a checker `text -> score in [0, 1]`, so a sampling
comparison can report quality beside diversity without a download or a judge model. Tasks
are a function of (kind, seed): the same seed always gives the same prompts.
"""

from __future__ import annotations

import dataclasses
import json
import random
import re
from collections.abc import Callable

_WORDS = (
    "amber",
    "basil",
    "cobalt",
    "delta",
    "ember",
    "fjord",
    "garnet",
    "harbor",
    "indigo",
    "juniper",
    "kelp",
    "lagoon",
    "maple",
    "nectar",
    "onyx",
    "pepper",
    "quartz",
    "raven",
    "saffron",
    "tundra",
    "umber",
    "velvet",
    "willow",
    "yarrow",
    "zephyr",
)
_NAMES = ("Maria", "Kenji", "Amara", "Lukas", "Priya", "Diego", "Ingrid", "Omar", "Chloe", "Tariq")
_CITIES = ("Lyon", "Osaka", "Nairobi", "Porto", "Quebec", "Tromso", "Cusco", "Hanoi", "Adelaide", "Bergen")
_ANIMALS = ("cat", "dog", "horse", "rabbit", "goat", "sheep", "duck", "fox", "owl", "bear", "wolf", "deer")


@dataclasses.dataclass(frozen=True, kw_only=True)
class Task:
    """One prompt with its checker."""

    kind: str
    prompt: str  # the user message
    answer: str  # what a perfect reply contains (for display)
    check: Callable[[str], float] = dataclasses.field(compare=False, repr=False)

    @property
    def messages(self) -> list[dict]:
        return [{"role": "user", "content": self.prompt}]


def _integers(text: str) -> list[int]:
    return [int(x) for x in re.findall(r"-?\d+", text.replace(",", ""))]


def arithmetic(seed: int) -> Task:
    rng = random.Random(seed)
    a, b = rng.randint(10, 99), rng.randint(10, 99)
    op = rng.choice("+-")
    value = a + b if op == "+" else a - b
    return Task(
        kind="arithmetic",
        prompt=f"What is {a} {op} {b}? Answer with the number only.",
        answer=str(value),
        check=lambda text: float(value in _integers(text)[:1]),
    )


def copying(seed: int, n_words: int = 5) -> Task:
    rng = random.Random(seed)
    target = " ".join(rng.sample(_WORDS, n_words))
    return Task(
        kind="copy",
        prompt=f"Repeat exactly, with nothing else: {target}",
        answer=target,
        check=lambda text: float(target in " ".join(text.split())),
    )


def _first_json_object(text: str) -> dict | None:
    start = text.find("{")
    while start >= 0:
        depth = 0
        for end in range(start, len(text)):
            depth += {"{": 1, "}": -1}.get(text[end], 0)
            if depth == 0:
                try:
                    value = json.loads(text[start : end + 1])
                    return value if isinstance(value, dict) else None
                except json.JSONDecodeError:
                    break
        start = text.find("{", start + 1)
    return None


def json_extraction(seed: int) -> Task:
    """Score: the share of the three fields a JSON object in the reply gets right."""
    rng = random.Random(seed)
    want = {"name": rng.choice(_NAMES), "age": rng.randint(18, 80), "city": rng.choice(_CITIES)}
    sentence = f"{want['name']} is {want['age']} years old and lives in {want['city']}."
    prompt = (
        f'Extract the person\'s name, age and city as a JSON object with keys "name", "age" and "city".\n'
        f"Sentence: {sentence}"
    )

    def check(text: str) -> float:
        got = _first_json_object(text) or {}
        return sum(str(got.get(k, "")).strip().lower() == str(v).lower() for k, v in want.items()) / len(want)

    return Task(kind="json", prompt=prompt, answer=json.dumps(want), check=check)


def counted_list(seed: int) -> Task:
    """Score: the share of the missing item numbers that appear, in order, at line starts."""
    rng = random.Random(seed)
    n = rng.randint(5, 8)
    given = rng.sample(_ANIMALS, 2)
    prompt = f"Continue this numbered list of animals until item {n}, one per line:\n1. {given[0]}\n2. {given[1]}"
    missing = list(range(3, n + 1))

    def check(text: str) -> float:
        numbers = [int(m) for m in re.findall(r"^\s*(\d+)[.)]", text, flags=re.MULTILINE)]
        found, at = 0, 0
        for k in missing:
            if k in numbers[at:]:
                at = numbers.index(k, at) + 1
                found += 1
        return found / len(missing)

    return Task(kind="list", prompt=prompt, answer="\n".join(f"{k}. ..." for k in missing), check=check)


KINDS: dict[str, Callable[[int], Task]] = {
    "arithmetic": arithmetic,
    "copy": copying,
    "json": json_extraction,
    "list": counted_list,
}


def make_tasks(n_each: int = 2, *, kinds: tuple[str, ...] = tuple(KINDS), seed: int = 0) -> list[Task]:
    """`n_each` tasks of each kind, interleaved by kind."""
    return [KINDS[k](seed * 1000 + i) for i in range(n_each) for k in kinds]
