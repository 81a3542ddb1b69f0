"""One-line input errors for the command-line tools (``tools/*.py``), as ``dapo-train`` prints them.

Bad input (a flag, a missing or damaged file) is printed as ``<prog>: error: <message>`` on
stderr, once, without a traceback, and the exit status is 2 (argparse's usage-error status);
any other exception keeps its traceback (a bug must stay visible). Under torchrun only rank 0
prints: an input error is the same on every rank, and a silent rank waits for rank 0 to print
and exit (torchrun stops every worker as soon as one exits non-zero), as ``dapo-train`` does
(:func:`dapo_megatron.train._input_error`).

Design: docs/design.md §1 (one training step; the command-line tools share these checks).
"""

from __future__ import annotations

import argparse
import math
import os
import sys
import time
from typing import Callable, Optional, Sequence, Union

from dapo_megatron.platform.console import quiet_third_party

RANK0_GRACE_S = 60.0  # how long a silent torchrun rank waits for rank 0 to print the error


class InputError(ValueError):
    """Bad input to a tool; the message names the flag or file and the fix."""


class ArgumentParser(argparse.ArgumentParser):
    """``argparse.ArgumentParser`` whose usage errors are one line (``prog: error: ...``, exit 2)."""

    def error(self, message: str):  # argparse prints the usage block first; one line here
        self.exit(2, f"{self.prog}: error: {message} (see --help)\n")


def positive_int(text: str) -> int:
    """argparse ``type=`` for an integer >= 1."""
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not an integer") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"{value} must be >= 1")
    return value


def report_input_error(prog: str, err: BaseException) -> int:
    """Print ``err`` as ``prog: error: ...`` (rank 0 only) and return 2."""
    msg = err.args[0] if isinstance(err, KeyError) and err.args else str(err)  # KeyError's str() adds quotes
    if os.environ.get("RANK", "0") == "0":
        print(f"{prog}: error: {msg}", file=sys.stderr, flush=True)
    elif "TORCHELASTIC_RUN_ID" in os.environ:
        time.sleep(RANK0_GRACE_S)  # rank 0 prints the same and exits; torchrun then ends this rank
    return 2


def run_tool(prog: str, main: Callable[[Optional[Sequence[str]]], object], argv: Optional[Sequence[str]] = None,
             input_errors: Union[tuple[type[BaseException], ...],
                                 Callable[[], tuple[type[BaseException], ...]]] = ()) -> int:
    """Run a tool's ``main(argv)``; :class:`InputError`, ``FileNotFoundError`` and ``input_errors``
    become one line and exit status 2, anything else propagates. Returns the exit status.

    ``input_errors`` may be a function returning the classes, called only when ``main`` raised
    something else than the three above: a tool whose error classes live in modules that load torch
    (``dapo_megatron.checkpointing``) then stops on a bad flag or path without loading torch (~1.2 s)."""
    quiet_third_party()  # the known-benign import warnings of megatron-core on CPU: one line means one line
    try:
        main(argv)
    except (InputError, FileNotFoundError, NotADirectoryError) as err:
        return report_input_error(prog, err)
    except Exception as err:  # not SystemExit (argparse's usage error): that needs no import
        if isinstance(err, input_errors() if callable(input_errors) else input_errors):
            return report_input_error(prog, err)
        raise
    return 0


def require_hf_source(hf: str, gguf_file: Optional[str]) -> None:
    """Raise :class:`InputError` unless ``--hf`` (with ``--gguf-file`` when given) names a model
    the bridge can open: an HF directory with ``config.json``, or a directory holding the GGUF
    file; a GGUF-only directory without ``--gguf-file`` gets the flag to add in its message."""
    if not os.path.isdir(hf):
        raise InputError(f"--hf {hf!r} is not a directory (an HF model directory, or one holding --gguf-file)")
    if gguf_file and not os.path.isfile(os.path.join(hf, gguf_file)):
        raise InputError(f"--gguf-file {gguf_file!r} is not in --hf {hf!r}")
    if not gguf_file and not os.path.isfile(os.path.join(hf, "config.json")):
        ggufs = sorted(f for f in os.listdir(hf) if f.endswith(".gguf"))
        raise InputError(f"--hf {hf!r} has no config.json (not an HF directory)"
                         + (f"; pass --gguf-file {ggufs[0]}" if ggufs else ""))


def launch_world_size(tp: int, pp: int, ep: int = 1, etp: Optional[int] = None) -> int:
    """The processes a tool's ``--tp/--pp/--ep/--etp`` layout needs: ``pp × lcm(tp, ep × etp)``
    (the fewest that both the dense grid TP × DP and the expert grid ETP × EP × EDP fill)."""
    return pp * math.lcm(tp, ep * (etp or tp))


def require_launch_world(tp: int, pp: int, ep: int = 1, etp: Optional[int] = None) -> None:
    """Raise :class:`InputError` (a one-line error of the tool, with the
    torchrun command to use) unless this launch has exactly :func:`launch_world_size` processes:
    the tools take their layout from ``--tp``/``--pp`` (``--ep``/``--etp`` for a mixture of
    experts; each >= 1, checked by their parsers)."""
    world = int(os.environ.get("WORLD_SIZE", "1"))
    need = launch_world_size(tp, pp, ep, etp)
    if world != need:
        layout = f"--tp {tp} × --pp {pp}" + (f" with --ep {ep}" + (f" --etp {etp}" if etp else "") if ep > 1 or etp else "")
        raise InputError(f"{layout} = {need} processes needed, running {world}: "
                         f"launch with torchrun --nproc_per_node={need}")
