"""Tooling around the runtime, kept out of it: the `specsplit` command line (cli.py),
`specsplit generate` (generate.py), the benchmarks (bench/) and draft distillation
(distill/). Nothing in gateway/ or the workers' serving path imports from here."""
