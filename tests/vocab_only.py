"""A GGUF's tokenizer alone (llama.cpp's `vocab_only` load: no weights, no context), for tests of
prompt tokenization that need a model's real vocabulary but not the model."""

from __future__ import annotations

import ctypes
from pathlib import Path

import llama_cpp

from edgeinfer.engine.chat.template import ChatVocab
from edgeinfer.llama_backend import backend

__all__ = ["VocabOnly"]


class VocabOnly:
    def __init__(self, path: str | Path):
        backend()
        params = llama_cpp.llama_model_default_params()
        params.vocab_only = True
        self.model = llama_cpp.llama_model_load_from_file(str(path).encode(), params)
        if not self.model:
            raise RuntimeError(f"cannot load the vocabulary of {path}")
        self.vocab = llama_cpp.llama_model_get_vocab(self.model)
        self.bos = llama_cpp.llama_vocab_bos(self.vocab)
        self.eos = llama_cpp.llama_vocab_eos(self.vocab)
        self.add_bos = bool(llama_cpp.llama_vocab_get_add_bos(self.vocab))

    def tokenize(self, text: str, parse_special: bool) -> list[int]:
        data = text.encode("utf-8")
        n_max = len(data) + 8
        buf = (llama_cpp.llama_token * n_max)()
        n = llama_cpp.llama_tokenize(self.vocab, data, len(data), buf, n_max, False, parse_special)
        assert n >= 0
        return list(buf[:n])

    def piece(self, token: int, special: bool = True) -> str:
        buf = ctypes.create_string_buffer(256)
        n = llama_cpp.llama_token_to_piece(self.vocab, token, buf, len(buf), 0, special)
        return buf.raw[:n].decode("utf-8", errors="replace")

    def is_control(self, token: int) -> bool:
        return bool(llama_cpp.llama_vocab_get_attr(self.vocab, token) & llama_cpp.LLAMA_TOKEN_ATTR_CONTROL)

    def chat_vocab(self) -> ChatVocab:
        return ChatVocab(bos_text=self.piece(self.bos) if self.bos >= 0 else "",
                         eos_text=self.piece(self.eos) if self.eos >= 0 else "",
                         bos_id=self.bos, add_bos=self.add_bos, tokenize=self.tokenize)

    def close(self) -> None:
        if self.model:
            llama_cpp.llama_model_free(self.model)
            self.model = None
