"""`HFTeacher`: a Hugging Face causal LM from a local checkpoint as a `Teacher`.

Loading never touches the network (`local_files_only`); install with
`pip install 'groupflow[hf]'`.
"""

from __future__ import annotations

from pathlib import Path

import torch

from groupflow.impl._teachers._torch import LogprobTeacher
from groupflow.model.errors import Unavailable


class HFTeacher(LogprobTeacher):
    """Right-padded rows with an attention mask, through `AutoModelForCausalLM`."""

    def logits(self, ids: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        out: torch.Tensor = self.model(input_ids=ids, attention_mask=mask).logits
        return out

    @classmethod
    def from_pretrained(
        cls,
        path: Path | str,
        *,
        dp_size: int = 1,
        device: str = "auto",
        dtype: torch.dtype = torch.float32,
    ) -> HFTeacher:
        """Load the model saved at `path` (nothing is downloaded); `dp_size`, `device` and
        `dtype` as for `TorchTeacher`, the longest row from the model's config."""
        try:
            from transformers import AutoModelForCausalLM
        except ImportError as exc:
            raise Unavailable("HFTeacher needs transformers: pip install 'groupflow[hf]'") from exc
        model = AutoModelForCausalLM.from_pretrained(Path(path), local_files_only=True, dtype=dtype)
        max_len = getattr(model.config, "max_position_embeddings", None)
        return cls(model, dp_size=dp_size, device=device, dtype=dtype, max_len=max_len)
