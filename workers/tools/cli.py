"""`specsplit`: the one entry point. Each subcommand lives in its own module,
imported only when it runs, and reads its options from a frozen pydantic
settings class: `--max-sessions` on the command line, `SPECSPLIT_MAX_SESSIONS`
in the environment, the field's default otherwise."""

from __future__ import annotations

import sys
from importlib import import_module

Table = dict[str, tuple[str, str]]  # name -> (module with main(argv), one line of help)

COMMANDS: Table = {
    "generate": ("workers.tools.generate", "generate text in-process (draft + target, no servers)"),
    "worker": ("workers.worker", "run a draft or target gRPC worker"),
    "gateway": ("gateway.main", "run the OpenAI-compatible gateway over worker pools"),
    "serve": ("gateway.serve", "run gateway + workers together on this machine"),
    "bench": ("workers.tools.bench", "benchmark SpecSplit (`specsplit bench --help`: the kinds)"),
    "distill": ("workers.tools.distill", "train a small draft model on a target's own answers"),
    "certs": ("workers.tools.certs", "write TLS certificates and a token for the workers"),
}


def usage(prog: str, table: Table, default: str | None = None) -> str:
    word = "KIND" if default else "COMMAND"
    first = f"[{word}]" if default else word
    lines = [f"usage: {prog} {first} [options]   ({prog} {word} --help)", ""]
    lines.append(f"{word.lower()}s (default: {default}):" if default else f"{word.lower()}s:")
    width = max(len(name) for name in table) + 2
    lines += [f"  {name:<{width}} {text}" for name, (_, text) in table.items()]
    return "\n".join(lines)


def dispatch(prog: str, table: Table, argv: list[str], default: str | None = None) -> None:
    """Runs `table[argv[0]]`'s main on the rest of argv, importing its module only now.

    With a `default`, argv may start with options instead of a name: they go to the default."""
    if argv and argv[0] in ("-h", "--help") or not argv and default is None:
        print(usage(prog, table, default))
        return
    if default is not None and (not argv or argv[0].startswith("-")):
        argv = [default, *argv]
    if argv[0] not in table:
        kind = "kind" if default else "command"
        sys.exit(f"{prog}: unknown {kind} {argv[0]!r}\n\n{usage(prog, table, default)}")
    import_module(table[argv[0]][0]).main(argv[1:])


def main(argv: list[str] | None = None) -> None:
    dispatch("specsplit", COMMANDS, sys.argv[1:] if argv is None else argv)


if __name__ == "__main__":
    main()
