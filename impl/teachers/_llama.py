"""`LlamaLM`: a small causal LM of the Llama architecture (Hugging Face transformers), with the
interface of `CausalLM` (`model(ids)` gives the logits, `model.cfg` its shape), so the trainer
trains it and `TorchTeacher` scores with it as with `CausalLM`; and what a server needs to load
it: a Hugging Face model folder (`save_folder`) whose weights `write_weights` replaces in place.

Inference engines (vLLM, SGLang) serve Hugging Face architectures, not `CausalLM`. The head
dimension is set apart from the width (`head_dim`, 64 by default): vLLM's CPU attention takes
64 and refuses the 16 of a 64-wide model with four heads. Needs transformers
(`pip install 'groupflow[hf]'`).
"""

from __future__ import annotations

import os
import tempfile
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import attrs
import torch
from torch import nn

from groupflow.impl.core import positive_int
from groupflow.model.errors import ConfigError, Unavailable

__all__ = ["WEIGHTS_FILE", "LlamaLM", "LlamaLMConfig"]

WEIGHTS_FILE = "model.safetensors"


def _transformers() -> Any:
    try:
        import transformers
    except ImportError as exc:
        raise Unavailable(
            "LlamaLM needs transformers: pip install 'groupflow[hf]' (or 'groupflow[vllm]')"
        ) from exc
    return transformers


@attrs.frozen
class LlamaLMConfig:
    """A Llama model's shape; `architecture` tells a saved one from a `CausalLM`'s `LMConfig`."""

    vocab_size: int = attrs.field(validator=positive_int)
    d_model: int = attrs.field(validator=positive_int)
    n_heads: int = attrs.field(validator=positive_int)
    n_layers: int = attrs.field(validator=positive_int)
    max_len: int = attrs.field(validator=positive_int)
    head_dim: int = attrs.field(default=64, validator=positive_int)
    d_ff: int | None = None
    init_std: float = 0.02
    """The spread of the initial weights (transformers' `initializer_range`)."""
    architecture: str = "llama"

    def __attrs_post_init__(self) -> None:
        if self.architecture != "llama":
            raise ConfigError(
                f"LlamaLMConfig.architecture={self.architecture!r} must be 'llama'",
                field="architecture",
                config="LlamaLMConfig",
            )

    def hf_config(self) -> Any:
        """The transformers `LlamaConfig`: no end-of-sequence token (a response is as long as
        the sampler asks), untied embeddings (each weight its own tensor in the file)."""
        return _transformers().LlamaConfig(
            vocab_size=self.vocab_size,
            hidden_size=self.d_model,
            intermediate_size=self.d_ff or 4 * self.d_model,
            num_hidden_layers=self.n_layers,
            num_attention_heads=self.n_heads,
            num_key_value_heads=self.n_heads,
            head_dim=self.head_dim,
            max_position_embeddings=self.max_len,
            bos_token_id=0,
            eos_token_id=None,
            pad_token_id=None,
            tie_word_embeddings=False,
            initializer_range=self.init_std,
        )


class LlamaLM(nn.Module):
    """`transformers.LlamaForCausalLM` of shape `cfg`, called as `CausalLM` is."""

    def __init__(self, cfg: LlamaLMConfig) -> None:
        super().__init__()
        self.cfg = cfg
        self.hf = _transformers().LlamaForCausalLM(cfg.hf_config())

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        logits: torch.Tensor = self.hf(input_ids=ids, use_cache=False).logits
        return logits

    def save_folder(self, folder: Path, words: Sequence[str]) -> Path:
        """Write a Hugging Face model folder a server loads: the config, the weights, and a
        word-level tokenizer whose token `i` is `words[i]` (engines want a tokenizer even when
        prompts are token ids)."""
        if len(words) != self.cfg.vocab_size or len(set(words)) != len(words):
            raise ConfigError(
                f"LlamaLM.save_folder: {len(words)} words (distinct: {len(set(words))}) for a "
                f"vocabulary of {self.cfg.vocab_size}; give one distinct word per token",
                field="words",
            )
        folder = Path(folder)
        folder.mkdir(parents=True, exist_ok=True)
        self.hf.config.save_pretrained(folder)
        _write_tokenizer(folder, words)
        self.write_weights(folder)
        return folder

    def write_weights(self, folder: Path) -> Path:
        """Replace the folder's weights with this model's, atomically (a server reloading
        reads the old file or the new one, never half of one)."""
        from safetensors.torch import save_file

        target = Path(folder) / WEIGHTS_FILE
        state = {
            k: v.detach().to("cpu", torch.float32).contiguous()
            for k, v in self.hf.state_dict().items()
        }
        fd, name = tempfile.mkstemp(prefix=f".{WEIGHTS_FILE}.", suffix=".tmp", dir=target.parent)
        os.close(fd)
        try:
            save_file(state, name, metadata={"format": "pt"})
            os.replace(name, target)
        finally:
            Path(name).unlink(missing_ok=True)
        return target


def _write_tokenizer(folder: Path, words: Sequence[str]) -> None:
    from tokenizers import Tokenizer, models, pre_tokenizers

    tokenizer = Tokenizer(
        models.WordLevel(vocab={w: i for i, w in enumerate(words)}, unk_token=words[0])
    )
    tokenizer.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    _transformers().PreTrainedTokenizerFast(
        tokenizer_object=tokenizer, unk_token=words[0], bos_token=words[0]
    ).save_pretrained(folder)
