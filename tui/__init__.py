"""edgeinfer terminal chat UI (installed as `edgeinfer_tui`)."""
