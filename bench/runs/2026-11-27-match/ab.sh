#!/bin/bash
# alternate base / new: chat 4,16 (5 pairs) then grounded 1,32 (4 pairs), each build
for v in base new; do
  cd /tmp/s37/$v
  PYTHONPATH=$PWD timeout 1500 .venv/bin/python -m workers.tools.cli bench paired --workload chat --streams 4,16 --pairs 5 --prompts 16 >> /tmp/s37/chat-$v.md 2>>/tmp/s37/$v.err
  PYTHONPATH=$PWD timeout 1500 .venv/bin/python -m workers.tools.cli bench paired --workload grounded --streams 1,32 --pairs 4 --prompts 16 >> /tmp/s37/grd-$v.md 2>>/tmp/s37/$v.err
done
echo done > /tmp/s37/ab.done
