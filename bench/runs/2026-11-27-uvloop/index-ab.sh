for spec in "grounded 1" "chat 1" "grounded 2"; do
  set -- $spec; w=$1; i=$2
  for build in c d; do
    cd /tmp/$build; export PYTHONPATH=/tmp/$build
    echo "## $build ($(git log --oneline -1 | cut -c1-7)) $w run $i $(date -u +%H:%M)"
    .venv/bin/specsplit bench paired --workload $w --streams 1,8,32 --pairs 3 --prompts 16 2>&1 | grep -E '^\||^machine'
  done
done
