"""`specsplit distill`: a small draft model trained on a target's own greedy answers.

prompts.py  the chat request sets (train, held-out topics, held-out kinds)
data.py     the target's answers and next-token distributions, cached batch by batch
model.py    the draft's shape, its kept vocabulary and how it is saved as a plain model
train.py    the KL training loop, checkpoints and agreement
run.py      the command: settings, the steps in order, the report

`specsplit bench draft` (workers/tools/bench/draft.py) measures the draft it makes.
"""

from workers.tools.distill.run import main

__all__ = ["main"]
