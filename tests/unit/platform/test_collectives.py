"""No ``torch.distributed`` collective outside ``dapo_megatron/platform/``, and none inside it
that leaves the group to the default (issue 20: the collectives are ParallelDims' methods and
``platform/collectives.py``, which take the group explicitly).

A source scan (``ast``): a call of a collective of ``torch.distributed`` under any alias
(``import torch.distributed as dist``, ``import torch`` then ``torch.distributed.x``,
``from torch import distributed``, ``from torch.distributed import all_reduce``). The running
checks of the methods are in ``test_parallel_dims.py`` (they share its two processes).
"""

from __future__ import annotations

import ast
import os

import pytest

from conftest import REPO

PKG = os.path.join(REPO, "dapo_megatron")
PLATFORM = os.path.join(PKG, "platform") + os.sep

#: every communicating function of torch.distributed (c10d's public collectives and point-to-point)
COLLECTIVES = frozenset({
    "all_reduce", "all_reduce_coalesced", "reduce", "broadcast", "all_gather", "all_gather_into_tensor",
    "_all_gather_base", "all_gather_coalesced", "reduce_scatter", "reduce_scatter_tensor", "_reduce_scatter_base",
    "all_to_all", "all_to_all_single", "gather", "scatter", "send", "recv", "isend", "irecv", "batch_isend_irecv",
    "all_gather_object", "broadcast_object_list", "gather_object", "scatter_object_list", "send_object_list",
    "recv_object_list", "barrier", "monitored_barrier",
})


def _dist_aliases(tree: ast.AST) -> tuple[set[str], set[str], dict[str, str]]:
    """Names bound to ``torch.distributed``, names bound to ``torch``, and collectives imported by
    name (local name -> collective)."""
    dist_names, torch_names, direct = set(), set(), {}
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for a in node.names:
                if a.name == "torch.distributed" and a.asname:
                    dist_names.add(a.asname)
                elif a.name.split(".")[0] == "torch" and not a.asname:
                    torch_names.add("torch")
                elif a.name == "torch" and a.asname:
                    torch_names.add(a.asname)
        elif isinstance(node, ast.ImportFrom) and not node.level:
            for a in node.names:
                if node.module == "torch" and a.name == "distributed":
                    dist_names.add(a.asname or a.name)
                elif node.module in ("torch.distributed", "torch.distributed.distributed_c10d") \
                        and a.name in COLLECTIVES:
                    direct[a.asname or a.name] = a.name
    return dist_names, torch_names, direct


def _is_dist(expr: ast.AST, dist_names: set[str], torch_names: set[str]) -> bool:
    if isinstance(expr, ast.Name):
        return expr.id in dist_names
    if isinstance(expr, ast.Attribute):
        if expr.attr == "distributed" and isinstance(expr.value, ast.Name) and expr.value.id in torch_names:
            return True
        if expr.attr == "distributed_c10d":  # dist.distributed_c10d.all_reduce
            return _is_dist(expr.value, dist_names, torch_names)
    return False


def collective_calls(source: str, path: str = "<src>") -> list[tuple[int, str, bool]]:
    """``(line, collective, passes an explicit non-None group=)`` for every call of a
    ``torch.distributed`` collective in ``source``."""
    tree = ast.parse(source, path)
    dist_names, torch_names, direct = _dist_aliases(tree)
    found = []
    for node in ast.walk(tree):
        if not isinstance(node, ast.Call):
            continue
        f, name = node.func, None
        if isinstance(f, ast.Attribute) and f.attr in COLLECTIVES and _is_dist(f.value, dist_names, torch_names):
            name = f.attr
        elif isinstance(f, ast.Name) and f.id in direct:
            name = direct[f.id]
        if name is None:
            continue
        group = next((k.value for k in node.keywords if k.arg == "group"), None)
        explicit = group is not None and not (isinstance(group, ast.Constant) and group.value is None)
        found.append((node.lineno, name, explicit))
    return found


def _package_files():
    for d, _, files in os.walk(PKG):
        for f in sorted(files):
            if f.endswith(".py"):
                yield os.path.join(d, f)


def violations(files) -> list[str]:
    """``path:line name`` of each collective outside platform/ and each one inside it without an
    explicit group."""
    bad = []
    for path in files:
        with open(path, encoding="utf-8") as fh:
            calls = collective_calls(fh.read(), path)
        inside = path.startswith(PLATFORM)
        rel = os.path.relpath(path, REPO)
        bad += [f"{rel}:{line} {name}" + ("" if inside else " (outside platform/)")
                for line, name, explicit in calls if not inside or not explicit]
    return bad


def test_no_collective_outside_platform_and_every_group_explicit():
    bad = violations(_package_files())
    assert not bad, ("torch.distributed collectives outside dapo_megatron/platform/ (call ParallelDims' methods or "
                     "platform.collectives) or without group= inside it:\n  " + "\n  ".join(bad))
    # the scan sees the package's collectives: platform/collectives.py holds them, each with its group
    with open(os.path.join(PLATFORM, "collectives.py"), encoding="utf-8") as fh:
        wrapped = collective_calls(fh.read())
    assert {name for _, name, _ in wrapped} >= {"broadcast_object_list", "all_gather_object", "gather_object",
                                                "barrier", "all_reduce", "broadcast", "all_gather",
                                                "all_gather_into_tensor", "all_to_all_single"}
    assert all(explicit for _, _, explicit in wrapped)


@pytest.mark.parametrize("source,want", [
    ("import torch.distributed as dist\ndist.broadcast_object_list(box, src=0)\n", [(2, "broadcast_object_list", False)]),
    ("import torch\ntorch.distributed.barrier()\n", [(2, "barrier", False)]),
    ("import torch\ntorch.distributed.all_reduce(t, group=None)\n", [(2, "all_reduce", False)]),
    ("from torch import distributed as d\nd.all_gather_object(out, x, group=g)\n", [(2, "all_gather_object", True)]),
    ("from torch.distributed import gather_object as go\ngo(x, parts, dst=0)\n", [(2, "gather_object", False)]),
    ("import torch.distributed as dist\ndist.distributed_c10d.all_reduce(t)\n", [(2, "all_reduce", False)]),
    # not collectives: reading ranks, groups, a method of ParallelDims, another module's barrier
    ("import torch.distributed as dist\ndist.get_rank(); dist.new_group([0]); parallel.barrier('world')\n"
     "threading.Barrier(2); other.all_reduce(t)\n", []),
])
def test_the_scan_finds_every_spelling(source, want):
    assert collective_calls(source) == want


def test_a_planted_default_group_call_is_reported(tmp_path):
    """The check fails where it should: a default-group broadcast in a module outside platform/,
    and a collective inside platform/ without its group."""
    outside = tmp_path / "trainer_like.py"
    outside.write_text("import torch.distributed as dist\n\ndef f(box):\n    dist.broadcast_object_list(box, src=0)\n")
    assert violations([str(outside)]) == [f"{os.path.relpath(outside, REPO)}:4 broadcast_object_list "
                                          "(outside platform/)"]
    inside = os.path.join(PLATFORM, "collectives.py")
    source = open(inside, encoding="utf-8").read().replace("dist.barrier(group=group)", "dist.barrier()")
    assert source != open(inside, encoding="utf-8").read()
    assert [(n, e) for _, n, e in collective_calls(source) if n == "barrier"] == [("barrier", False)]
