"""The configuration reference and the keys' other names: `hpcgnn config` and docs/config.md
list every key of the schema, the page is what `make docs` writes today, the minibatch engine's
older key names (the DistGNN-MB paper's symbols) load to the same values, and every command's
--help ends with its examples."""
from __future__ import annotations

import importlib
import json
import re
import subprocess
import sys
from pathlib import Path

import pytest

from hpcgnn.cli import SUBCOMMANDS, main
from hpcgnn.commands.config import reference, render_markdown, toml_value
from hpcgnn.errors import InputError
from hpcgnn.run.config import canonical_names, load_config, schema
from hpcgnn.run.resume import config_changes

ROOT = Path(__file__).resolve().parents[2]
PAGE = ROOT / "docs" / "config.md"

OLD = {"delay": 2, "nc": 7, "cs": 99, "ls": 0}
NEW = {"push_delay": 2, "push_limit": 7, "cache_lines": 99, "cache_lifespan": 0}


def _hpcgnn(*args) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "hpcgnn", *args], cwd=ROOT, capture_output=True,
                          text=True, timeout=60)


def _toml(path: Path, minibatch: dict) -> Path:
    body = "\n".join(f"{k} = {v}" for k, v in minibatch.items())
    path.write_text(f'[data]\npartitions = "p"\n[model]\nlayers = 2\n[minibatch]\nfanouts = [5, 5]\n{body}\n')
    return path


def test_page_is_what_make_docs_writes():
    assert PAGE.read_text() == render_markdown(reference()), \
        "docs/config.md is out of date with the schema: run `make docs`"


def test_command_and_page_list_every_key():
    out = _hpcgnn("config")
    assert out.returncode == 0, out.stderr
    page = PAGE.read_text()
    sections = re.split(r"^## ", page, flags=re.M)[1:]
    by_section = {s.split("`")[1].strip("[]"): s for s in sections}
    assert list(by_section) == list(schema())
    for section, keys in schema().items():
        assert f"[{section}]" in out.stdout
        for key, spec in keys.items():
            assert f"  {section}.{key} = {toml_value(spec.default)}  (" in out.stdout, (section, key)
            row = next((line for line in by_section[section].splitlines() if line.startswith(f"| `{key}` |")),
                       None)
            assert row is not None, (section, key)
            for alias in spec.aliases:
                assert f"`{alias}`" in row and f"other names: {alias}" in out.stdout
    rows = sum(len(keys) for keys in schema().values())
    assert len(re.findall(r"^\| `", page, flags=re.M)) == rows


def test_one_section_or_key():
    out = _hpcgnn("config", "minibatch")
    assert out.returncode == 0
    assert out.stdout.startswith("[minibatch]") and "[train]" not in out.stdout
    assert "minibatch.cache_lines = 1000000  (int; > 0; engines: minibatch; other names: cs)" in out.stdout
    one = _hpcgnn("config", "store.hotness")
    assert one.returncode == 0
    assert re.findall(r"^  store\.\w+", one.stdout, flags=re.M) == ["  store.hotness"]
    assert "engines: minibatch" in one.stdout
    for bad, said in [("nope", "unknown section 'nope'"), ("train.nope", "unknown key train.nope")]:
        out = _hpcgnn("config", bad)
        assert out.returncode == 2 and out.stdout == ""
        assert out.stderr.count("\n") == 1 and said in out.stderr


def test_old_minibatch_names_load_to_the_same_values(tmp_path):
    old = load_config(_toml(tmp_path / "old.toml", OLD))
    new = load_config(_toml(tmp_path / "new.toml", NEW))
    assert old.to_dict() == new.to_dict()
    assert [old.minibatch.push_delay, old.minibatch.push_limit, old.minibatch.cache_lines,
            old.minibatch.cache_lifespan] == [2, 7, 99, 0]
    assert not set(OLD) & set(old.to_dict()["minibatch"])     # the run file holds the new names
    by_set = load_config(_toml(tmp_path / "plain.toml", {}), [f"minibatch.{k}={v}" for k, v in OLD.items()])
    assert by_set.to_dict() == new.to_dict()
    # an old name's value is checked as the key's own
    with pytest.raises(InputError, match=r"minibatch\.push_delay = 0, expected >= 1"):
        load_config(_toml(tmp_path / "bad.toml", {"delay": 0}))


def test_a_key_given_under_both_names_is_refused(tmp_path):
    with pytest.raises(InputError) as exc:
        load_config(_toml(tmp_path / "both.toml", {"nc": 5, "push_limit": 6}))
    assert "minibatch.nc and minibatch.push_limit are the same setting" in str(exc.value)


def test_an_override_replaces_the_files_value_under_either_name(tmp_path):
    old_file = _toml(tmp_path / "old.toml", {"nc": 5})
    new_file = _toml(tmp_path / "new.toml", {"push_limit": 5})
    for path in (old_file, new_file):
        for name in ("nc", "push_limit"):
            assert load_config(path, [f"minibatch.{name}=9"]).minibatch.push_limit == 9
    assert load_config(old_file).minibatch.push_limit == 5


def test_run_files_with_old_names_read_as_new(tmp_path):
    """A run file (or checkpoint) written with the older names: no setting counts as changed on
    --resume, and inference reads its values."""
    from hpcgnn.commands.infer import run_config

    cfg = load_config(_toml(tmp_path / "new.toml", NEW)).to_dict()
    stored = json.loads(json.dumps(cfg))
    for old, new in zip(OLD, NEW):
        stored["minibatch"][old] = stored["minibatch"].pop(new)
    assert canonical_names(stored) == cfg
    assert config_changes(stored, cfg) == []
    assert run_config(json.dumps(stored), "run.h5").minibatch.cache_lines == 99


def test_shipped_configs_use_the_current_names():
    aliases = {a for keys in schema().values() for spec in keys.values() for a in spec.aliases}
    for path in sorted((ROOT / "inputs").glob("*.toml")):
        names = set(re.findall(r"^(\w+) *=", path.read_text(), flags=re.M))
        assert not names & aliases, (path.name, names & aliases)


@pytest.mark.parametrize("command", list(SUBCOMMANDS))
def test_help_ends_with_examples(command, capsys):
    examples = importlib.import_module(f"hpcgnn.commands.{command}").EXAMPLES
    assert examples.startswith("examples:\n") and f"hpcgnn {command}" in examples
    with pytest.raises(SystemExit) as done:
        main([command, "--help"])
    assert done.value.code == 0
    assert capsys.readouterr().out.endswith(examples)
