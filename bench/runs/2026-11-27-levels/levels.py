"""Per-level top-1 of a head directory (fed its own states beyond level 1), both held-out sets.

    python bench/runs/2026-11-27-levels/levels.py HEAD_DIR DATA_DIR LEVELS

from the repository root; DATA_DIR is a distill run's OUT/checkpoint/data made with the
options below (bench/DRAFT.md, "EAGLE heads on the teacher's own states"); the held-out
states come from the bfloat16 target, as `specsplit distill` computes them.
"""

import sys
import time
from pathlib import Path

import torch
from transformers import AutoModelForCausalLM

from workers.engine.engine import Engine, EngineConfig
from workers.engine.loader import load_tokenizer, resolve_model
from workers.tools.distill.data import DataSpec, Teacher, collect
from workers.tools.distill.eagle import EagleTrainer, agreement, target_states
from workers.tools.distill.model import choose_vocab

TARGET = "smollm2-135m-instruct"

torch.set_num_threads(2)
head_dir, data_dir, levels = Path(sys.argv[1]), Path(sys.argv[2]), int(sys.argv[3])
spec = DataSpec(846742, 32, 128, 320, 32, 32, 0, states=True)
examples, held = collect(data_dir, spec, None, print)
path = resolve_model(TARGET)
target = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
special = load_tokenizer(path).all_special_ids
kept = choose_vocab(examples, target.config.vocab_size, 8192, special)
trainer = EagleTrainer(target, 0, kept)
trainer.init_from(head_dir)
config = EngineConfig(
    TARGET, dtype="bfloat16", max_sessions=32, max_seq_len=spec.context, kernel_threads=2
)
engine = Engine.load(config)
engine.torch_beside_kernel()
teacher = Teacher(engine, load_tokenizer(path))
states = {split: target_states(lambda: teacher, ex) for split, ex in held.items()}
torch.set_num_threads(2)
for split, ex in held.items():
    start = time.perf_counter()
    result = agreement(trainer, ex, states[split], levels)
    rounded = {k: [round(x, 3) for x in v] if isinstance(v, list) else round(v, 3)
               for k, v in result.items()}  # fmt: skip
    print(head_dir.name, split, rounded, f"{time.perf_counter() - start:.0f}s", flush=True)
