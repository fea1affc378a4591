"""Model definition (SPEC §4): the Llama-style decoder and its builder."""

from model.llama import Llama, LlamaConfig, build_model, swiglu_hidden

__all__ = ["LlamaConfig", "Llama", "build_model", "swiglu_hidden"]
