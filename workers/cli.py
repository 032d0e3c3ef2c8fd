"""`specsplit`: the one entry point. Each subcommand lives in its own module,
imported only when it runs, and reads its options from a frozen pydantic
settings class: `--max-sessions` on the command line, `SPECSPLIT_MAX_SESSIONS`
in the environment, the field's default otherwise."""

from __future__ import annotations

import sys
from importlib import import_module

COMMANDS = {
    "generate": ("workers.generate", "generate text in-process (draft + target, no servers)"),
    "worker": ("workers.worker", "run a draft or target gRPC worker"),
    "gateway": ("gateway.main", "run the OpenAI-compatible gateway over worker pools"),
    "serve": ("gateway.serve", "run gateway + workers together on this machine"),
    "bench": ("workers.bench", "benchmark SpecSplit against plain and assisted decoding"),
    "distill": ("workers.distill", "train a small draft model on a target's own answers"),
}


def usage() -> str:
    lines = ["usage: specsplit COMMAND [options]   (specsplit COMMAND --help)", "", "commands:"]
    lines += [f"  {name:<10} {text}" for name, (_, text) in COMMANDS.items()]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> None:
    argv = sys.argv[1:] if argv is None else argv
    if not argv or argv[0] in ("-h", "--help"):
        print(usage())
        return
    if argv[0] not in COMMANDS:
        sys.exit(f"specsplit: unknown command {argv[0]!r}\n\n{usage()}")
    module = import_module(COMMANDS[argv[0]][0])
    module.main(argv[1:])


if __name__ == "__main__":
    main()
