"""The child side of `edgeinfer.quantize`, run as a script: `python -I quantize_child.py < REQUEST.json`.

`llama_model_quantize` is one C call that nothing can interrupt: run in the caller's process, a
cancel or Ctrl-C could only wait for it to finish (minutes for a large model). In a child it ends
the moment the parent kills it, and an abort inside llama.cpp kills the child, not the caller.

The request (JSON on stdin) names the source and the output file and holds the quantize
parameters as llama.cpp's numbers; llama.cpp's log (one line per tensor) goes to stdout, from which
the parent reads progress. Exit status: llama_model_quantize's return code (0: done).

It imports only the standard library, llama.cpp's bindings (child_llama.py) and, for an importance
matrix, numpy (not the edgeinfer package), like `load_probe.py`, so it starts fast; `-I` keeps
the script's folder off sys.path.
"""

from __future__ import annotations

import ctypes
import json
import os
import signal
import sys
from typing import Any

__all__ = ["quantize", "main"]

_PR_SET_PDEATHSIG = 1

# fields of llama_model_quantize_params this script sets; checked against the struct, because
# ctypes silently accepts an assignment to a field the struct does not declare
_FIELDS = ("nthread", "ftype", "allow_requantize", "quantize_output_tensor", "pure",
           "output_tensor_type", "token_embedding_type", "tt_overrides", "imatrix", "kv_overrides")


def _llama():
    """llama.cpp's ctypes bindings without the rest of the llama_cpp package (child_llama.py, run
    by its path: -I keeps this folder off sys.path)."""
    import runpy
    from pathlib import Path

    return runpy.run_path(str(Path(__file__).with_name("child_llama.py")))["bindings"]()


def quantize(request: dict[str, Any]) -> int:
    ll = _llama()
    ll.llama_backend_init()

    @ll.llama_log_callback
    def on_log(_level: int, text: bytes, _user: ctypes.c_void_p) -> None:
        sys.stdout.write(text.decode("utf-8", errors="replace"))
        sys.stdout.flush()

    ll.llama_log_set(on_log, ctypes.c_void_p(0))
    declared = {name for name, *_ in ll.llama_model_quantize_params._fields_}
    missing = [f for f in _FIELDS if f not in declared]
    if missing:
        raise RuntimeError(f"llama_model_quantize_params has no field {', '.join(missing)}")

    params = ll.llama_model_quantize_default_params()
    params.nthread = int(request["nthread"])
    params.ftype = int(request["ftype"])
    params.allow_requantize = bool(request["allow_requantize"])
    params.quantize_output_tensor = True
    params.pure = False
    if request.get("output_tensor_type") is not None:
        params.output_tensor_type = int(request["output_tensor_type"])
    if request.get("token_embedding_type") is not None:
        params.token_embedding_type = int(request["token_embedding_type"])
    keepalive: list[Any] = []
    overrides = request.get("overrides") or []
    if overrides:
        arr = (ll.llama_model_tensor_override * (len(overrides) + 1))()
        for i, (pattern, type_id) in enumerate(overrides):
            b = ctypes.c_char_p(pattern.encode())
            keepalive.append(b)
            arr[i].pattern = b.value
            arr[i].type = int(type_id)
        arr[len(overrides)].pattern = None
        keepalive.append(arr)
        params.tt_overrides = ctypes.cast(arr, ctypes.POINTER(ll.llama_model_tensor_override))
    if request.get("file_type") is not None:  # general.file_type written over the base ftype's (TYPE_RECIPES)
        kv = (ll.llama_model_kv_override * 2)()
        kv[0].key = b"general.file_type"
        kv[0].tag = ll.LLAMA_KV_OVERRIDE_TYPE_INT
        kv[0].value.val_i64 = int(request["file_type"])
        kv[1].key = b""  # the end: an empty key
        keepalive.append(kv)
        params.kv_overrides = ctypes.cast(kv, ctypes.POINTER(ll.llama_model_kv_override))
    if request.get("imatrix"):
        import numpy as np  # only here: numpy is a sixth of a child's start-up

        with np.load(request["imatrix"]) as entries:
            names = list(entries.files)
            arr = (ll.llama_model_imatrix_data * (len(names) + 1))()
            for i, name in enumerate(names):
                values = np.ascontiguousarray(entries[name], dtype=np.float32)
                nb = name.encode()
                keepalive += [nb, values]
                arr[i].name = nb
                arr[i].data = values.ctypes.data_as(ctypes.POINTER(ctypes.c_float))
                arr[i].size = values.size
        arr[len(names)].name = None
        keepalive.append(arr)
        params.imatrix = ctypes.cast(arr, ctypes.POINTER(ll.llama_model_imatrix_data))
    rc = int(ll.llama_model_quantize(request["source"].encode(), request["output"].encode(), ctypes.byref(params)))
    del keepalive
    return rc


def _die_with_parent(parent_pid: int) -> None:
    """A parent killed outright (SIGKILL: no chance to kill us) must not leave us quantizing into
    a partial file that then looks alive to `gc`: ask Linux for SIGKILL when the parent goes."""
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(_PR_SET_PDEATHSIG, signal.SIGKILL)
    except (OSError, AttributeError):  # not Linux: the parent's cancel/Ctrl-C paths still kill us
        pass
    if os.getppid() != parent_pid:  # the parent died before prctl took effect
        sys.exit(1)


def main() -> int:
    try:
        request = json.load(sys.stdin)
        _die_with_parent(int(request["parent_pid"]))
        return quantize(request)
    except Exception as e:  # noqa: BLE001 - any failure reaches the parent as one line
        print(f"\nedgeinfer-quantize: error: {type(e).__name__}: {e}", flush=True)
        return 3


if __name__ == "__main__":
    sys.exit(main())
