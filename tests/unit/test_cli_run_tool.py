"""dapo_megatron.cli.run_tool: which exceptions become one line and exit status 2 (in process, ~0 s)."""

import pytest

from dapo_megatron.cli import InputError, run_tool


class _LateError(ValueError):
    """Stands for an error class of a module that loads torch (dapo_megatron.checkpointing)."""


def _raising(err):
    def main(argv):
        raise err
    return main


def test_input_errors_given_as_a_function_are_looked_up_only_for_other_exceptions(capsys):
    asked = []

    def late():
        asked.append(1)
        return (_LateError,)

    assert run_tool("tool", _raising(InputError("--x 'y' is bad")), None, late) == 2
    assert run_tool("tool", _raising(FileNotFoundError("--f 'z' is not a file")), None, late) == 2
    with pytest.raises(SystemExit):  # argparse's usage error passes through untouched
        run_tool("tool", _raising(SystemExit(2)), None, late)
    assert asked == []  # none of these needed the late classes (nor the imports behind them)
    assert capsys.readouterr().err == "tool: error: --x 'y' is bad\ntool: error: --f 'z' is not a file\n"

    assert run_tool("tool", _raising(_LateError("step_3 is truncated")), None, late) == 2
    assert asked == [1] and capsys.readouterr().err == "tool: error: step_3 is truncated\n"
    with pytest.raises(RuntimeError, match="a bug"):  # anything else keeps its traceback
        run_tool("tool", _raising(RuntimeError("a bug")), None, late)
    with pytest.raises(RuntimeError, match="a bug"):
        run_tool("tool", _raising(RuntimeError("a bug")), None, (_LateError,))
    assert run_tool("tool", _raising(_LateError("as a tuple")), None, (_LateError,)) == 2
    assert run_tool("tool", lambda argv: None, None, late) == 0
