#!/bin/bash
# base = 44b5af4 (/tmp/s37/new), new = the producer task (/tmp/s37/prod); chat 8,16 (5 pairs)
for v in new prod new prod; do
  cd /tmp/s37/$v
  PYTHONPATH=$PWD timeout 1500 .venv/bin/python -m workers.tools.cli bench paired --workload chat --streams 8,16 --pairs 5 --prompts 16 >> /tmp/s37/p-chat-$v.md 2>>/tmp/s37/p-$v.err
done
echo done > /tmp/s37/ab2.done
