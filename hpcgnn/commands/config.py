"""`hpcgnn config [SECTION[.KEY]] [--markdown]`: the configuration reference.

Prints every key of the training configuration's schema (:func:`hpcgnn.run.config.schema`: the
core sections and each registered engine's section) with its type, default, allowed values,
the engines that read it, its other names and its help. ``--markdown`` prints the same as the
page docs/config.md (``make docs`` writes it; a test keeps the two equal). Reads no data and
imports no torch.
"""
from __future__ import annotations

import json
import textwrap

from hpcgnn.errors import InputError

EXAMPLES = """examples:
  hpcgnn config                        every section and key
  hpcgnn config minibatch              the minibatch engine's keys
  hpcgnn config train.engine           one key
  hpcgnn config --markdown > docs/config.md
"""

MARKDOWN_INTRO = """\
# Configuration reference

A run reads one TOML file (`hpcgnn train --config FILE`) with the sections below; every key is
optional and takes its default when absent, except `data.partitions`. `--set SECTION.KEY=VALUE`
overrides a key on the command line (the value is TOML; a bare word is a string), e.g.
`--set train.epochs=5 --set "minibatch.fanouts=[10, 10]"`. An unknown section or key, a wrong type
or a value out of range stops the run before it starts, with one line naming the key.

"Engines" says which values of `train.engine` read a key. A key's "other names" load as the key
itself (a configuration written with them reads the same). `hpcgnn config [SECTION]` prints this
reference in a terminal.

This page is generated from the schema: `make docs` (or
`python -m hpcgnn config --markdown > docs/config.md`) writes it.
"""


def add_arguments(parser) -> None:
    parser.add_argument("name", nargs="?", metavar="SECTION[.KEY]",
                        help="only this section (e.g. minibatch) or key (e.g. train.engine)")
    parser.add_argument("--markdown", action="store_true",
                        help="print the reference as the Markdown page docs/config.md")


def toml_value(value) -> str:
    """``value`` as it is written in a TOML file."""
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, str):
        return json.dumps(value)
    if isinstance(value, list):
        return "[" + ", ".join(toml_value(v) for v in value) + "]"
    return repr(value)


def type_name(key) -> str:
    """The key's type(s) in words: ``int``, ``int or list``, ``str, int or float``."""
    names = [t.__name__ for t in (key.type if isinstance(key.type, tuple) else (key.type,))]
    return names[0] if len(names) == 1 else ", ".join(names[:-1]) + " or " + names[-1]


def allowed(key) -> str:
    """The values the key accepts, in words ('' when its type says it all)."""
    if key.choices:
        return ", ".join(toml_value(c) for c in key.choices)
    return key.expect


def reference(name: str | None = None) -> list[tuple[str, str, list[dict]]]:
    """``[(section, its description, [row per key])]`` for every section, or for the one
    section or key ``name`` names (InputError naming the choices otherwise). A row holds
    ``key``, ``type``, ``default``, ``allowed``, ``engines``, ``aliases`` and ``help``."""
    from hpcgnn.run.config import key_engines, schema, section_help

    sections = schema()
    section, _, only = (name or "").partition(".")
    if section and section not in sections:
        raise InputError(f"config: unknown section {section!r}, expected one of {', '.join(sections)}")
    if only and only not in sections[section]:
        raise InputError(f"config: unknown key {section}.{only}; known keys: {', '.join(sections[section])}")
    out = []
    for sec, keys in sections.items():
        if section and sec != section:
            continue
        rows = [{"key": k, "type": type_name(spec), "default": toml_value(spec.default),
                 "allowed": allowed(spec), "engines": list(key_engines(sec, spec)),
                 "aliases": list(spec.aliases), "help": spec.help}
                for k, spec in keys.items() if not only or k == only]
        out.append((sec, section_help(sec), rows))
    return out


def render_text(ref, width: int = 100) -> str:
    """The reference for a terminal: a header per section, then per key its line
    ``key = default  (type; allowed; engines ...)`` and its help, indented."""
    from hpcgnn.run.engines.registry import ENGINE_NAMES

    lines = []
    for sec, about, rows in ref:
        lines.extend(textwrap.wrap(f"[{sec}]  {about}", width, subsequent_indent="    "))
        for r in rows:
            facts = [r["type"]] + ([r["allowed"]] if r["allowed"] else [])
            facts.append("engines: " + ("all" if r["engines"] == list(ENGINE_NAMES) else ", ".join(r["engines"])))
            if r["aliases"]:
                facts.append("other names: " + ", ".join(r["aliases"]))
            lines.extend(textwrap.wrap(f"{sec}.{r['key']} = {r['default']}  ({'; '.join(facts)})",
                                       width, initial_indent="  ", subsequent_indent="      "))
            lines.extend(textwrap.wrap(r["help"], width, initial_indent="      ",
                                       subsequent_indent="      "))
        lines.append("")
    return "\n".join(lines)


def _cell(text: str) -> str:
    return text.replace("|", "\\|").replace("\n", " ")


def render_markdown(ref) -> str:
    """The reference as the Markdown page docs/config.md: the introduction, then one table per
    section."""
    from hpcgnn.run.engines.registry import ENGINE_NAMES

    out = [MARKDOWN_INTRO]
    for sec, about, rows in ref:
        out.append(f"## `[{sec}]`\n\n{about[:1].upper() + about[1:]}.\n")
        out.append("| Key | Type | Default | Allowed | Engines | Description |")
        out.append("|---|---|---|---|---|---|")
        for r in rows:
            engines = "all" if r["engines"] == list(ENGINE_NAMES) else ", ".join(r["engines"])
            desc = r["help"] + (f" Other names: {', '.join(f'`{a}`' for a in r['aliases'])}."
                                if r["aliases"] else "")
            out.append(f"| `{r['key']}` | {r['type']} | `{_cell(r['default'])}` | "
                       f"{_cell(r['allowed'])} | {engines} | {_cell(desc)} |")
        out.append("")
    return "\n".join(out)


def run(args) -> int:
    ref = reference(args.name)
    print(render_markdown(ref) if args.markdown else render_text(ref), end="")
    return 0
