"""`TorchTeacher`: a causal language model in plain torch that scores response tokens.

Rows of different lengths are right-padded; attention is causal, so a real token only ever sees
earlier tokens of its own row and never a pad: a row's log-probs do not depend on what else is in
the batch (up to float rounding, see `batch_tolerance`). Import this module only where torch is
installed (`pip install 'groupflow[torch]'`).
"""

from __future__ import annotations

import functools
from collections.abc import Sequence
from pathlib import Path

import attrs
import torch
import torch.nn.functional as F
from torch import nn

from groupflow.impl._pipeline import ThreadedScorer
from groupflow.impl._teachers._batch import TEACHER_INPUTS, score_request
from groupflow.impl._teachers._served_lm import (
    GPT2LM,
    GPT2LMConfig,
    LlamaLM,
    LlamaLMConfig,
    ServedLM,
)
from groupflow.impl.contract import ScoreRequest, TokenRow
from groupflow.model.errors import (
    ArgumentError,
    CheckpointCorrupt,
    CheckpointNotFound,
    ConfigError,
    Unavailable,
)


@attrs.frozen
class LMConfig:
    vocab_size: int = 256
    d_model: int = 64
    n_heads: int = 4
    n_layers: int = 2
    max_len: int = 1024
    d_ff: int | None = None

    def __attrs_post_init__(self) -> None:
        if self.d_model % self.n_heads:
            raise ConfigError(
                f"d_model={self.d_model} must be a multiple of n_heads={self.n_heads}",
                field="d_model",
                config="LMConfig",
            )


PRESETS = {
    "tiny": LMConfig(vocab_size=256, d_model=64, n_heads=4, n_layers=2, max_len=1024),
    "small": LMConfig(vocab_size=4096, d_model=256, n_heads=8, n_layers=4, max_len=4096),
    # Qwen3-1.7B's sizes (vocabulary, width, depth, heads, MLP) in this plain architecture: about
    # 1.8B parameters, for timing a teacher of that shape on a GPU (random weights).
    "qwen3-1.7b-shape": LMConfig(
        vocab_size=151936, d_model=2048, n_heads=16, n_layers=28, max_len=4096, d_ff=6144
    ),
}


class _Block(nn.Module):
    def __init__(self, cfg: LMConfig) -> None:
        super().__init__()
        self.n_heads = cfg.n_heads
        self.ln1 = nn.LayerNorm(cfg.d_model)
        self.qkv = nn.Linear(cfg.d_model, 3 * cfg.d_model)
        self.proj = nn.Linear(cfg.d_model, cfg.d_model)
        self.ln2 = nn.LayerNorm(cfg.d_model)
        hidden = cfg.d_ff or 4 * cfg.d_model
        self.mlp = nn.Sequential(
            nn.Linear(cfg.d_model, hidden), nn.GELU(), nn.Linear(hidden, cfg.d_model)
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, d = x.shape
        q, k, v = self.qkv(self.ln1(x)).split(d, dim=-1)
        shape = (b, t, self.n_heads, d // self.n_heads)
        q, k, v = (z.view(shape).transpose(1, 2) for z in (q, k, v))
        attended = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.proj(attended.transpose(1, 2).reshape(b, t, d))
        out: torch.Tensor = x + self.mlp(self.ln2(x))
        return out


class CausalLM(nn.Module):
    """Token and position embeddings, pre-norm transformer blocks, a language-model head."""

    def __init__(self, cfg: LMConfig) -> None:
        super().__init__()
        self.cfg = cfg
        self.tok = nn.Embedding(cfg.vocab_size, cfg.d_model)
        self.pos = nn.Embedding(cfg.max_len, cfg.d_model)
        self.blocks = nn.ModuleList(_Block(cfg) for _ in range(cfg.n_layers))
        self.ln = nn.LayerNorm(cfg.d_model)
        self.head = nn.Linear(cfg.d_model, cfg.vocab_size, bias=False)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        positions = torch.arange(ids.shape[1], device=ids.device)
        x = self.tok(ids) + self.pos(positions)
        for block in self.blocks:
            x = block(x)
        logits: torch.Tensor = self.head(self.ln(x))
        return logits


AnyLM = CausalLM | ServedLM
"""The models the embedded trainer and `TorchTeacher` run: `model(ids)` gives the logits and
`model.cfg` the shape."""


def new_lm(cfg: LMConfig | LlamaLMConfig | GPT2LMConfig, *, seed: int) -> AnyLM:
    """A model of shape `cfg` (its type says the architecture) with fresh weights drawn from
    `seed`; the global RNG is left as it was."""
    state = torch.random.get_rng_state()
    torch.manual_seed(seed)
    try:
        if isinstance(cfg, LlamaLMConfig):
            return LlamaLM(cfg)
        if isinstance(cfg, GPT2LMConfig):
            return GPT2LM(cfg)
        return CausalLM(cfg)
    finally:
        torch.random.set_rng_state(state)


def _config_of(saved: dict[str, object]) -> LMConfig | LlamaLMConfig | GPT2LMConfig:
    if saved.get("architecture") == "llama":
        return LlamaLMConfig(**saved)  # type: ignore[arg-type]
    if saved.get("architecture") == "gpt2":
        return GPT2LMConfig(**saved)  # type: ignore[arg-type]
    return LMConfig(**saved)  # type: ignore[arg-type]


def resolve_device(device: str) -> torch.device:
    if device == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if device.startswith("cuda") and not torch.cuda.is_available():
        raise Unavailable(f"device={device!r} asked for, but torch sees no CUDA device")
    try:
        return torch.device(device)
    except RuntimeError:
        raise ArgumentError(
            f"device={device!r} is not a torch device: use auto, cpu, cuda or cuda:N"
        ) from None


def reference_logprobs(model: nn.Module, row: TokenRow) -> list[float]:
    """The definition, for one row alone: log_softmax of the logits at each position, taken at
    the next token, over the response."""
    with torch.inference_mode():
        ids = torch.tensor([row.input_ids], device=next(model.parameters()).device)
        logp = torch.log_softmax(model(ids).float(), dim=-1)[0]
        targets = ids[0, row.prompt_length :]
        picked = logp[row.prompt_length - 1 : len(row.input_ids) - 1].gather(-1, targets[:, None])
        return [float(v) for v in picked[:, 0].cpu()]


class LogprobTeacher:
    """What every torch-backed `Teacher` shares: right-padding, one forward pass per shard, the
    log-prob of each response token. Subclasses say how to get logits."""

    reads = TEACHER_INPUTS
    """What `score` reads from each row (checked against the generator's fields)."""

    def __init__(
        self,
        model: nn.Module,
        *,
        dp_size: int = 1,
        device: str = "auto",
        dtype: torch.dtype = torch.float32,
        max_len: int | None = None,
    ) -> None:
        if dp_size < 1:
            raise ConfigError(
                f"dp_size must be >= 1, got {dp_size}", field="dp_size", config=type(self).__name__
            )
        self._dp_size = dp_size
        self.device = resolve_device(device)
        self.dtype = dtype
        self.max_len = max_len
        self.model = model.to(device=self.device, dtype=dtype).eval()

    @property
    def dp_size(self) -> int:
        return self._dp_size

    @property
    def num_parameters(self) -> int:
        """How many weights the model has (its size, not `nn.Module.parameters`)."""
        return sum(p.numel() for p in self.model.parameters())

    def logits(self, ids: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        raise NotImplementedError

    def score_shards(self, shards: Sequence[Sequence[TokenRow]]) -> list[list[Sequence[float]]]:
        return [self._score(shard) for shard in shards]

    async def score(self, request: ScoreRequest) -> None:
        """The `Scorer` the teacher stage calls, like any fake or remote scorer: the batch is
        scored by `score_teacher_batch` in a worker thread (`ThreadedScorer`: waited for when
        cancelled, abandoned only once it ignores that for `abandon_after_s`)."""
        await ThreadedScorer(functools.partial(score_request, self)).score(request)

    def _score(self, rows: Sequence[TokenRow]) -> list[Sequence[float]]:
        if not rows:
            return []
        longest = max(len(r.input_ids) for r in rows)
        if self.max_len is not None and longest > self.max_len:
            raise ArgumentError(f"a row of {longest} tokens exceeds max_len={self.max_len}")
        ids = torch.zeros((len(rows), longest), dtype=torch.long)
        mask = torch.zeros((len(rows), longest), dtype=torch.long)
        for i, row in enumerate(rows):
            ids[i, : len(row.input_ids)] = torch.tensor(row.input_ids)
            mask[i, : len(row.input_ids)] = 1
        with torch.inference_mode():
            ids, mask = ids.to(self.device), mask.to(self.device)
            logp = torch.log_softmax(self.logits(ids, mask).float(), dim=-1)
            picked = logp[:, :-1].gather(-1, ids[:, 1:, None])[..., 0].cpu()
        return [
            picked[i, row.prompt_length - 1 : len(row.input_ids) - 1].tolist()
            for i, row in enumerate(rows)
        ]


class TorchTeacher(LogprobTeacher):
    """A `Teacher` on `CausalLM` or a served architecture (`LlamaLM`, `GPT2LM`): one model, `dp_size` shards scored in turn (one
    process here; a Ray worker group would run the shards on separate ranks). Right padding
    needs no mask: attention is causal, so real tokens never reach the pads after them."""

    model: AnyLM

    def __init__(
        self,
        model: AnyLM,
        *,
        dp_size: int = 1,
        device: str = "auto",
        dtype: torch.dtype = torch.float32,
        max_len: int | None = None,
    ) -> None:
        """`dp_size`: shards per batch (DP ranks); `device`: "auto" (CUDA when torch sees
        one), "cpu", "cuda:0", ...; `dtype` of the weights; `max_len`: longest row accepted,
        at most (and by default) the model's `max_len`."""
        limit = model.cfg.max_len
        if max_len is not None and not 1 <= max_len <= limit:
            raise ConfigError(
                f"max_len={max_len} must be between 1 and the model's max_len={limit}",
                field="max_len",
                config="TorchTeacher",
            )
        super().__init__(
            model, dp_size=dp_size, device=device, dtype=dtype, max_len=max_len or limit
        )

    def logits(self, ids: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        out: torch.Tensor = self.model(ids)
        return out

    @classmethod
    def from_config(
        cls,
        cfg: LMConfig | LlamaLMConfig | GPT2LMConfig,
        *,
        seed: int = 0,
        dp_size: int = 1,
        device: str = "auto",
        dtype: torch.dtype = torch.float32,
    ) -> TorchTeacher:
        """A teacher with fresh random weights drawn from `seed` (`new_lm`)."""
        return cls(new_lm(cfg, seed=seed), dp_size=dp_size, device=device, dtype=dtype)

    def save(self, path: Path) -> None:
        torch.save(
            {"config": attrs.asdict(self.model.cfg), "state": self.model.state_dict()}, Path(path)
        )

    @classmethod
    def load(
        cls,
        path: Path,
        *,
        dp_size: int = 1,
        device: str = "auto",
        dtype: torch.dtype = torch.float32,
    ) -> TorchTeacher:
        """A teacher saved by `save` (loaded weights-only: no code runs). A missing file is
        `CheckpointNotFound`; one that does not load as a saved teacher (not a torch file, not
        weights-only, missing keys, wrong shapes) is `CheckpointCorrupt`, naming the path."""
        path = Path(path)
        if not path.is_file():
            raise CheckpointNotFound(f"teacher {path}: no such file (a TorchTeacher.save file)")
        try:
            saved = torch.load(path, map_location="cpu", weights_only=True)
        except Exception as exc:  # torch's own advice (load it unsafely) is not for a user here
            raise CheckpointCorrupt(
                f"teacher {path} is not a file of torch weights ({type(exc).__name__} from "
                f"torch.load); give a file TorchTeacher.save wrote"
            ) from exc
        try:
            model = new_lm(_config_of(saved["config"]), seed=0)
            model.load_state_dict(saved["state"])
        except Exception as exc:
            reason = str(exc).splitlines()[0] if str(exc) else type(exc).__name__
            raise CheckpointCorrupt(
                f"teacher {path} does not load as a TorchTeacher.save file: {reason}"
            ) from exc
        return cls(model, dp_size=dp_size, device=device, dtype=dtype)


def batch_tolerance(dtype: torch.dtype) -> float:
    """How far a row's log-probs may move with what else is in the batch (float rounding in
    batched matrix products): an absolute bound per token."""
    return {torch.float32: 1e-4, torch.bfloat16: 5e-2, torch.float16: 1e-2}.get(dtype, 1e-4)


def random_rows(n: int, *, length: int, prompt: int, vocab: int, seed: int) -> list[TokenRow]:
    """Rows of random tokens, for benchmarks and tests."""
    g = torch.Generator().manual_seed(seed)
    rows = []
    for _ in range(n):
        ids = torch.randint(0, vocab, (length,), generator=g).tolist()
        rows.append(TokenRow(tuple(ids), prompt))
    return rows


__all__ = [
    "PRESETS",
    "CausalLM",
    "LMConfig",
    "LogprobTeacher",
    "TorchTeacher",
    "batch_tolerance",
    "random_rows",
    "reference_logprobs",
    "resolve_device",
]
