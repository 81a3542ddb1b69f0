"""``sglang.srt.server_args`` of the fake SGLang (see ``sglang/__init__.py``), after sglang 0.5.23
``python/sglang/srt/server_args.py``.

The real ``ServerArgs`` is a ``msgspec.Struct`` (``server_args.py:551``: ``msgspec.defstruct(
"ServerArgs", ...)`` over the fields of ``arg_groups/fields/*.py``), not a dataclass. What the
package reads of it is reproduced here without msgspec (not installed on the CPU machines):

* ``ServerArgs.__struct_fields__``: the field names, as msgspec sets them on every Struct class
  (the pinned list, ``dapo_megatron.platform.sglang_server_args.SERVER_ARGS_FIELDS``);
* ``ServerArgs(**kwargs)``: keyword arguments only (``Engine`` passes them so), and an unknown
  one raises ``TypeError("Unexpected keyword argument 'name'")``, msgspec's message, checked
  against msgspec 0.23 and sglang 0.5.23's ``ServerArgs(model_path="x", no_such_field=1)``;
* fields not given read as ``None`` here except the few the fake engine uses (the real defaults
  live in the namespace classes).
"""

from __future__ import annotations

from dapo_megatron.platform.sglang_server_args import SERVER_ARGS_FIELDS

#: sglang 0.5.23's defaults of the fields the fake engine reads (``ServerArgs(model_path=...)``)
_DEFAULTS = {"tp_size": 1, "base_gpu_id": 0, "gpu_id_step": 1, "dist_timeout": None, "enable_symm_mem": False,
             "enable_nccl_nvls": False, "custom_sigquit_handler": None, "log_level": "info"}


class ServerArgs:
    __struct_fields__ = tuple(sorted(SERVER_ARGS_FIELDS))

    def __init__(self, **kwargs):
        if "model_path" not in kwargs:
            raise TypeError("Missing required argument 'model_path'")
        for name in kwargs:
            if name not in SERVER_ARGS_FIELDS:
                raise TypeError(f"Unexpected keyword argument {name!r}")
        for name in self.__struct_fields__:
            setattr(self, name, kwargs.get(name, _DEFAULTS.get(name)))
