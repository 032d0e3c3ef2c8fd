"""`specsplit bench suffix`: its workloads (the timed run needs the embedded model and minutes)."""

from __future__ import annotations

from workers.tools.bench.suffix import FILE, QUESTIONS, edited_file, question_prompts


def test_every_wording_of_every_question_is_asked_each_round():
    prompts = question_prompts(rounds=2)
    wordings = {q for question in QUESTIONS for q in question}
    assert len(prompts) == 2 * len(wordings)
    assert [p[0]["content"] for p in prompts[: len(QUESTIONS)]] == [q[0] for q in QUESTIONS]


def test_the_next_edit_starts_from_the_code_block_of_the_answer():
    answer = "Sure:\n```python\nx = 1\n```\nDone."
    assert edited_file(answer, FILE) == "x = 1\n"
    assert edited_file("no code here", FILE) == FILE
    assert edited_file("```python\n```", FILE) == FILE
