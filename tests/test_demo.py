"""`longstraw demo` (longstraw/demo.py): what its screen says."""

import json
import warnings

import pytest

from longstraw import demo as demo_module
from longstraw.cli import main
from longstraw.skips import NoUpdateWarning

SMALL = ["demo", "--family", "qwen3", "--prompt-tokens", "24", "--group", "2", "--response-tokens", "2",
         "--chunk-size", "8"]


def test_the_demo_reports_generates_capture_explains_the_loss_and_warns_when_nothing_updates(capsys, monkeypatch):
    """Every reward equal (the toy reward made constant): the step changes no weight and one
    warning says why and what to change; the table's loss row sits beside the gradient norm
    with the note; the JSON's time_capture_s is the capture that ran inside generate."""
    monkeypatch.setattr(demo_module, "toy_reward", lambda response, vocab: 0.5)
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")  # as -W always: ours is the only warning on the screen
        assert main(SMALL) == 0
    out = capsys.readouterr().out
    assert [w.category for w in seen] == [NoUpdateWarning], [str(w.message) for w in seen]
    assert "equal rewards" in str(seen[0].message) and "--seed" in str(seen[0].message)
    report = json.loads(out.strip().splitlines()[-1])
    assert report["no_update"] == "no update (equal rewards)"
    assert report["time_capture_s"] == report["generate_time_capture_s"] > 0
    assert "gradient norm (what trains)" in out and "about 0 by construction" in out


@pytest.mark.parametrize("flag,value", [("--prompt-tokens", "1"), ("--group", "0"), ("--response-tokens", "0"),
                                        ("--chunk-size", "0"), ("--lr", "-1"), ("--family", "nope")])
def test_a_bad_demo_flag_is_one_line_before_the_model_is_built(flag, value, capsys, monkeypatch):
    monkeypatch.setattr(demo_module, "tiny_model", lambda *a, **k: pytest.fail("the model was built"))
    assert_refused = pytest.raises(SystemExit) if flag == "--family" else None
    if assert_refused is None:
        assert main([*SMALL, flag, value]) == 2
    else:
        with assert_refused as info:
            main([*SMALL, flag, value])
        assert info.value.code == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("longstraw: ConfigError: ") and flag.lstrip("-") in err[0]
