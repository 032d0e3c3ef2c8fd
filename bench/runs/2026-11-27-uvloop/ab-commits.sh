for i in 1 2; do
  for w in chat grounded; do
    for build in a b; do
      cd /tmp/$build
      if [ $build = a ]; then export PYTHONPATH=/tmp/hide:/tmp/a; else export PYTHONPATH=/tmp/b; fi
      echo "## $build ($(git log --oneline -1 | cut -c1-7)) $w run $i $(date -u +%H:%M)"
      .venv/bin/specsplit bench paired --workload $w --streams 1,8,32 --pairs 3 --prompts 16 2>&1 | grep -E '^\||^machine'
    done
  done
done
