"""The tuned profile in `run`, `chat` and `serve`: the model's `edgeinfer tune` choice fills every
setting its flags leave unset; `--untuned` ignores it. A profile that no longer holds (another
machine or llama.cpp build, a changed model file) is not used, and one line on stderr says why."""

from __future__ import annotations

import argparse
import sys
from dataclasses import dataclass
from typing import Any

__all__ = ["add_untuned_option", "Tuned", "tuned_for"]


def add_untuned_option(p: argparse.ArgumentParser) -> None:
    p.add_argument("--untuned", action="store_true",
                   help="ignore the model's tuned profile (`edgeinfer tune`): the library's defaults for what the "
                   "flags leave unset")


@dataclass(frozen=True)
class Tuned:
    """What the profile sets, if one is used (setup None: none is)."""

    model: str | None  # the store ref to load (the rung the profile runs), or what was asked for
    setup: Any | None  # edgeinfer.tune.Setup
    serve: dict[str, int] | None = None  # parallel slots and context for `serve` (tune --serve)

    def load_fields(self, given: dict[str, Any]) -> dict[str, Any]:
        """LoadOptions fields: `given` (the flags' values, None where unset) over the profile's."""
        out = {k: v for k, v in given.items() if v is not None}
        s = self.setup
        if s is None:
            return out
        if "kv_type" not in out and "kv_type_k" not in out and "kv_type_v" not in out:
            out.update(kv_type=s.kv_type_k, kv_type_k=s.kv_type_k, kv_type_v=s.kv_type_v)
        if "n_threads" not in out and s.threads is not None:
            out["n_threads"] = s.threads
        if "flash_attn" not in out and s.flash_attn is not None:
            out["flash_attn"] = s.flash_attn
        return out

    def speculate(self, given: str | None) -> tuple[str, int | None]:
        """The speculation (CLI form) and its draft_max: the flag's, else the profile's, else off."""
        if given is not None or self.setup is None:
            return (given or "off"), None
        return self.setup.speculate, self.setup.draft_max


def tuned_for(model: str | None, untuned: bool) -> Tuned:
    """The profile of `model` (None: the default model) when it has one that holds; a note on stderr
    says what is used, or why a profile is not."""
    import edgeinfer

    if untuned:
        return Tuned(model, None)
    store = edgeinfer.Store()
    try:
        _path, manifest = store.resolve(model)
    except edgeinfer.ModelNotFoundError:
        return Tuned(model, None)  # the load that follows says it properly
    status = edgeinfer.tuned_status(store, manifest)
    if status.profile is None and status.reason is None:
        return Tuned(model, None)
    if not status.usable:
        print(f"edgeinfer: note: not using the tuned profile of {manifest.ref}: {status.reason} "
              f"(`edgeinfer tune {manifest.ref}` makes a new one)", file=sys.stderr)
        return Tuned(model, None)
    setup = status.profile.setup
    print(f"edgeinfer: tuned: {setup.label(short_model=False)} (flags override it; --untuned ignores it)",
          file=sys.stderr)
    return Tuned(setup.model, setup, status.profile.serve)
