#!/bin/bash
# alternate base / new, paired bench each
W=$1; STREAMS=$2; PAIRS=$3; TAG=$4
for v in base new base new; do
  cd /tmp/s36/$v && PYTHONPATH=$PWD timeout 1500 .venv/bin/python -m workers.tools.cli bench paired --workload $W --streams $STREAMS --pairs $PAIRS --prompts 16 >> /tmp/s36/$TAG-$v.md 2>>/tmp/s36/$TAG-$v.err
done
echo done > /tmp/s36/$TAG.done
