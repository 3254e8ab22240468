"""What llama.cpp asserts on, refused by us first: the semantic half of GGUF validation.

`gguf_file.read_gguf` proves a file is well-formed; llama.cpp still aborts the whole process
(GGML_ASSERT, an uncaught C++ exception) on some well-formed files: a `block_count` of 2^32-1, a
NaN `rms_epsilon`, two vocabulary entries with the same text, `tokenizer.ggml.model = "none"`, an
F16 norm. `check_semantics` refuses those with one line naming the key or tensor. The rules mirror
the vendored llama.cpp (llama-model.cpp `load_hparams`, llama-vocab.cpp `load`, the per-arch
`load_arch_tensors` of llama/qwen2/qwen3, models/qwen35.cpp and models/eagle3.cpp); for
architectures we do not convert only the generic checks apply.

No list of rules is complete, so a file never loaded before is first loaded by llama.cpp in a
child process (`probe_load`, running the script `edgeinfer/load_probe.py`): an abort there becomes
InvalidModelError("llama.cpp could not load X: <its last log line>") and this process lives.
`LoadChecks` remembers files that passed (sha256 + size, in the store's cache; store manifests
record it as `load_checked`) so the child runs once per file. `admit` is the whole gate.

    semantics.py        check_semantics, validate_file (remembers the files it validated)
    vocabulary.py       the vocabulary llama.cpp builds
    hyperparameters.py  the hyper-parameters it reads
    tensors.py          the tensors of any file, then its architecture's rules
    arch/               the rules of each architecture we convert (dense llama/qwen2/qwen3, qwen35, eagle3)
    metadata.py         reading metadata and tensors as the rules need them
    probe.py            the load in a child process
    admission.py        the whole gate (admit) and what it remembers (LoadChecks)
"""

from __future__ import annotations

from .admission import PROBE_ENV, TRUSTED_SHA256, LoadChecks, admit
from .probe import probe_load
from .semantics import check_semantics, validate_file

__all__ = [
    "check_semantics",
    "validate_file",
    "probe_load",
    "LoadChecks",
    "admit",
    "TRUSTED_SHA256",
    "PROBE_ENV",
]
