"""Small causal LMs in architectures inference engines serve (Hugging Face transformers), with
the interface of `CausalLM` (`model(ids)` gives the logits, `model.cfg` its shape), so the
trainer trains them and `TorchTeacher` scores with them as with `CausalLM`; and what a server
needs to load one: a Hugging Face model folder (`save_folder`) whose weights `write_weights`
replaces in place.

Two architectures: `LlamaLM` (rotary positions: what the domain teachers of a served run are)
and `GPT2LM` (learned absolute positions: the served student). Inference engines (vLLM,
SGLang) serve Hugging Face architectures, not `CausalLM`; vLLM's CPU attention takes heads of
32, 64 and wider dimensions and refuses the 16 of a 64-wide model with four heads (a Llama's
head dimension is set apart from its width, `head_dim`; a GPT-2's is its width over its
heads). Needs transformers (`pip install 'groupflow[hf]'`).
"""

from __future__ import annotations

import math
import os
import tempfile
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import attrs
import torch
from torch import nn

from groupflow.impl._core import positive_int
from groupflow.model.errors import ConfigError, Unavailable

__all__ = ["WEIGHTS_FILE", "GPT2LM", "GPT2LMConfig", "LlamaLM", "LlamaLMConfig", "ServedLM"]

WEIGHTS_FILE = "model.safetensors"


def _transformers() -> Any:
    try:
        import transformers
    except ImportError as exc:
        raise Unavailable(
            "a served model (LlamaLM, GPT2LM) needs transformers: pip install 'groupflow[hf]' "
            "(or 'groupflow[engines]')"
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


@attrs.frozen
class GPT2LMConfig:
    """A GPT-2 model's shape; `architecture` tells a saved one from the others' configs."""

    vocab_size: int = attrs.field(validator=positive_int)
    d_model: int = attrs.field(validator=positive_int)
    n_heads: int = attrs.field(validator=positive_int)
    n_layers: int = attrs.field(validator=positive_int)
    max_len: int = attrs.field(validator=positive_int)
    d_ff: int | None = None
    architecture: str = "gpt2"

    def __attrs_post_init__(self) -> None:
        if self.architecture != "gpt2":
            raise ConfigError(
                f"GPT2LMConfig.architecture={self.architecture!r} must be 'gpt2'",
                field="architecture",
                config="GPT2LMConfig",
            )
        if self.d_model % self.n_heads:
            raise ConfigError(
                f"GPT2LMConfig.d_model={self.d_model} must be a multiple of "
                f"n_heads={self.n_heads} (a head's dimension is their quotient)",
                field="d_model",
                config="GPT2LMConfig",
            )

    def hf_config(self) -> Any:
        """The transformers `GPT2Config`: no dropout (the learner's log-probs are the served
        ones), no end-of-sequence token, untied embeddings (each weight its own tensor)."""
        return _transformers().GPT2Config(
            vocab_size=self.vocab_size,
            n_embd=self.d_model,
            n_head=self.n_heads,
            n_layer=self.n_layers,
            n_positions=self.max_len,
            n_inner=self.d_ff,
            resid_pdrop=0.0,
            embd_pdrop=0.0,
            attn_pdrop=0.0,
            bos_token_id=0,
            eos_token_id=None,
            tie_word_embeddings=False,
        )


ServedConfig = LlamaLMConfig | GPT2LMConfig


class ServedLM(nn.Module):
    """A transformers causal LM of shape `cfg`, called as `CausalLM` is, that a server loads
    from the folder `save_folder` writes."""

    def __init__(self, cfg: ServedConfig, hf: Any) -> None:
        super().__init__()
        self.cfg = cfg
        self.hf: Any = hf  # a transformers model (untyped)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        logits: torch.Tensor = self.hf(input_ids=ids, use_cache=False).logits
        return logits

    def save_folder(self, folder: Path, words: Sequence[str]) -> Path:
        """Write a Hugging Face model folder a server loads: the config, the weights, and a
        word-level tokenizer whose token `i` is `words[i]` (engines want a tokenizer even when
        prompts are token ids)."""
        if len(words) != self.cfg.vocab_size or len(set(words)) != len(words):
            raise ConfigError(
                f"{type(self).__name__}.save_folder: {len(words)} words (distinct: {len(set(words))}) for a "
                f"vocabulary of {self.cfg.vocab_size}; give one distinct word per token",
                field="words",
            )
        folder = Path(folder)
        folder.mkdir(parents=True, exist_ok=True)
        # named, or an engine guesses from the model type (vLLM takes a GPT-2 folder without
        # it for a pooling model, which serves no completions)
        self.hf.config.architectures = [type(self.hf).__name__]
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


class LlamaLM(ServedLM):
    """`transformers.LlamaForCausalLM` of shape `cfg`, its weights spread by `cfg.init_std`."""

    def __init__(self, cfg: LlamaLMConfig) -> None:
        super().__init__(cfg, _transformers().LlamaForCausalLM(cfg.hf_config()))


class GPT2LM(ServedLM):
    """`transformers.GPT2LMHeadModel` of shape `cfg`, its weights drawn as torch draws a new
    layer's (as `CausalLM`'s are): GPT-2's own spread (0.02) starts a student from a policy so
    near uniform that on-policy distillation barely moves it (measured: nothing learned in 300
    steps of the served run), where torch's start it spread enough to sample the right tokens."""

    def __init__(self, cfg: GPT2LMConfig) -> None:
        super().__init__(cfg, _transformers().GPT2LMHeadModel(cfg.hf_config()))
        for module in self.hf.modules():
            if isinstance(module, nn.Embedding):
                nn.init.normal_(module.weight)
            elif isinstance(module, nn.Linear):
                module.reset_parameters()
            elif type(module).__name__ == "Conv1D":  # transformers' transposed Linear
                weight: torch.Tensor = module.weight
                bias: torch.Tensor = module.bias
                bound = 1.0 / math.sqrt(weight.shape[0])
                nn.init.uniform_(weight, -bound, bound)
                nn.init.uniform_(bias, -bound, bound)


def _write_tokenizer(folder: Path, words: Sequence[str]) -> None:
    from tokenizers import Tokenizer, models, pre_tokenizers

    tokenizer = Tokenizer(
        models.WordLevel(vocab={w: i for i, w in enumerate(words)}, unk_token=words[0])
    )
    tokenizer.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    _transformers().PreTrainedTokenizerFast(
        tokenizer_object=tokenizer, unk_token=words[0], bos_token=words[0]
    ).save_pretrained(folder)
