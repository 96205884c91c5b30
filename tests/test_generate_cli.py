"""`metal-attn generate`'s --temp and --top-p take exactly what the engine takes
(`SamplingParams.validate`'s own rule): a value the engine would refuse is a usage error (exit 2)
from the flag parser, before any model is loaded. (The summary's rates: tests/test_engine_stats.py.)"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys

import pytest

from metal_attn import cli
from metal_attn.engine import SamplingParams
from metal_attn.errors import InvalidInputError
from metal_attn.generate import _temperature, _top_p

TEMP_ALLOWED = "(allowed: 0 (greedy), or a number >= 1e-30: the logits are divided by it in float32)"
TOP_P_ALLOWED = "(allowed: a number in [1e-30, 1]; 1 disables it; it is compared in float32)"


def _engine_takes(**kw) -> bool:
    try:
        SamplingParams(**kw).validate()
    except InvalidInputError:
        return False
    return True


@pytest.mark.parametrize("text", ["0", "1e-30", "0.7", "1", "5", "1e308", "-1", "-0.5", "1e-31", "1e-40", "inf",
                                  "-inf", "nan", "abc", ""])
def test_temp_takes_what_the_engine_takes(text):
    value = float(text) if text not in ("abc", "") else float("nan")
    if _engine_takes(temperature=value):
        assert _temperature(text) == value
    else:
        with pytest.raises(argparse.ArgumentTypeError) as err:
            _temperature(text)
        assert str(err.value) == f"invalid value {text!r} {TEMP_ALLOWED}"


@pytest.mark.parametrize("text", ["1", "0.9", "1e-30", "0", "-0.1", "1.0001", "1e-31", "1e-40", "1e-46", "inf",
                                  "nan", "x"])
def test_top_p_takes_what_the_engine_takes(text):
    value = float(text) if text != "x" else float("nan")
    if _engine_takes(top_p=value):
        assert _top_p(text) == value
    else:
        with pytest.raises(argparse.ArgumentTypeError) as err:
            _top_p(text)
        assert str(err.value) == f"invalid value {text!r} {TOP_P_ALLOWED}"


@pytest.mark.parametrize(("argv", "message"), [
    (["--temp", "1e-40"], f"argument --temp: invalid value '1e-40' {TEMP_ALLOWED}"),
    (["--temp", "inf"], f"argument --temp: invalid value 'inf' {TEMP_ALLOWED}"),
    (["--top-p", "1e-40"], f"argument --top-p: invalid value '1e-40' {TOP_P_ALLOWED}"),
])
def test_a_value_the_engine_refuses_exits_2_before_the_model_loads(capsys, monkeypatch, argv, message):
    """The reviewer's cases: refused by the engine after the model loaded and the pool was allocated."""
    import metal_attn.mlx_lm as mlx_lm_pkg

    monkeypatch.setattr(mlx_lm_pkg, "load", lambda *a, **k: pytest.fail("the model was loaded"))
    try:
        code = cli.main(["generate", *argv])
    except SystemExit as exc:
        code = exc.code
    assert code == 2
    assert message in " ".join(capsys.readouterr().err.split())


def test_a_fresh_process_refuses_temp_1e_40_without_a_model(tmp_path):
    """In a process of its own, with no model in its cache and no index to fetch one from (loading would
    exit 1 naming pip): exit 2 with the parser's message, nothing on stdout."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("METAL_ATTN_")}
    env |= {"METAL_ATTN_PLUGIN_AUTOLOAD": "0", "METAL_ATTN_CACHE_DIR": str(tmp_path), "PIP_INDEX_URL":
            "http://127.0.0.1:9/simple", "PIP_CONFIG_FILE": os.devnull, "PIP_RETRIES": "0", "PIP_TIMEOUT": "1"}
    done = subprocess.run([sys.executable, "-m", "metal_attn", "generate", "--temp", "1e-40"], capture_output=True,
                          text=True, timeout=300, env=env, cwd=tmp_path)
    assert done.returncode == 2, done.stderr
    assert f"argument --temp: invalid value '1e-40' {TEMP_ALLOWED}" in " ".join(done.stderr.split())
    assert done.stdout == "" and not list(tmp_path.rglob("*.gguf"))


def test_the_flag_parser_s_rule_loads_no_mlx_lm():
    """`metal_attn.engine` loads its names on first use, so the parser's check (`metal_attn.engine.request`)
    answers without importing mlx-lm and transformers (about 1.2 s on this CPU); the engine itself still does."""
    code = ("import sys; import metal_attn.engine.request; assert 'mlx_lm' not in sys.modules, 'mlx_lm loaded'; "
            "from metal_attn.engine import Engine; assert 'mlx_lm' in sys.modules; print('ok')")
    env = dict(os.environ, METAL_ATTN_PLUGIN_AUTOLOAD="0", PYTHONPATH=os.pathsep.join(sys.path))
    res = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=120)
    assert res.returncode == 0 and res.stdout.strip() == "ok", res.stdout + res.stderr


def test_an_input_error_s_allowed_part_is_its_message_s_or_the_whole_message():
    assert InvalidInputError("top_k=-1 (allowed: an int >= 0)").allowed == "(allowed: an int >= 0)"
    assert InvalidInputError("no convention here").allowed == "(no convention here)"
