"""The seam of hpcgnn.engine.hooks.make_hooks: HPCGNN_TRAIN_HOOKS names a Python file whose
make_hooks(cfg, rt, out) gives a run its hooks (the test suite's tests/debug_hooks.py)."""
from __future__ import annotations

import types
from pathlib import Path

import pytest

from hpcgnn.engine.hooks import HOOKS_VAR, TrainHooks, make_hooks
from hpcgnn.errors import InputError

DEBUG_HOOKS = Path(__file__).resolve().parents[1] / "debug_hooks.py"


def test_without_the_variable_the_hooks_do_nothing(monkeypatch):
    monkeypatch.delenv(HOOKS_VAR, raising=False)
    assert type(make_hooks(None, None, None)) is TrainHooks


def test_the_named_file_gives_the_hooks(monkeypatch, tmp_path):
    rt = types.SimpleNamespace(rank=1)
    out = types.SimpleNamespace(debug_dir=tmp_path / "debug")
    monkeypatch.setenv(HOOKS_VAR, str(DEBUG_HOOKS))
    monkeypatch.setenv("HPCGNN_DEBUG_HOOKS", '{"kill": [1, 2, 3, "SIGUSR1"], "record": true}')
    hooks = make_hooks(None, rt, out)
    assert type(hooks).__name__ == "DebugHooks" and isinstance(hooks, TrainHooks)
    assert hooks.kill == [1, 2, 3, "SIGUSR1"] and hooks.path == tmp_path / "debug" / "rank-00001.h5"
    assert hooks.wants_layer_inputs and hooks.wants_exchanges
    monkeypatch.setenv("HPCGNN_DEBUG_HOOKS", "{}")
    assert type(make_hooks(None, rt, out)) is TrainHooks        # nothing asked for: no-op hooks


def test_a_missing_file_or_a_file_without_hooks_is_one_input_error(monkeypatch, tmp_path):
    monkeypatch.setenv(HOOKS_VAR, str(tmp_path / "none.py"))
    with pytest.raises(InputError, match=f"{HOOKS_VAR}=.*none.py: no such file; expected a Python file"):
        make_hooks(None, None, None)
    bad = tmp_path / "bad.py"
    bad.write_text("def make_hooks(cfg, rt, out):\n    return object()\n")
    monkeypatch.setenv(HOOKS_VAR, str(bad))
    with pytest.raises(InputError, match="bad.py: expected a Python file whose make_hooks"):
        make_hooks(None, None, None)
    bad.write_text("x = 1\n")
    with pytest.raises(InputError, match="bad.py: expected a Python file whose make_hooks"):
        make_hooks(None, None, None)
