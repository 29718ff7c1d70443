"""Domain teachers: trained to the accuracy bar, cached and reused, rebuilt (with a warning) when
the cached file is damaged or made for another teacher, never left half-written; `--teacher
DOMAIN=PATH` parsed and loaded, refused when it does not fit the task.

Each cache check is a plain function, so the seeded bugs at the end can run it under a small
change of behaviour and show that it fails there."""

from __future__ import annotations

import logging
import shutil
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import attrs
import pytest

torch = pytest.importorskip("torch", reason="torch not installed: pip install 'groupflow[train]'")

from groupflow.impl._core import default_cache_dir  # noqa: E402
from groupflow.impl._teachers._torch import LMConfig, TorchTeacher  # noqa: E402
from groupflow.impl._trainer import (  # noqa: E402
    ANSWER_LENGTH,
    DOMAINS,
    PROMPT_LENGTH,
    VOCAB,
    _domain_teachers,
    _teacher_cache,
    _teacher_override,
    make_prompts,
    parse_teacher_override,
    teacher_from_path,
)
from groupflow.impl._trainer._domain_teachers import (  # noqa: E402
    DEFAULT_RECIPE,
    TARGET_ACCURACY,
    TEACHER_CONFIG,
    TeacherRecipe,
    domain_teacher,
    held_out_prompts,
    train_domain_teacher,
)
from groupflow.impl._trainer._greedy import greedy_accuracy, greedy_answers  # noqa: E402
from groupflow.model.errors import (  # noqa: E402
    ArgumentError,
    CheckpointCorrupt,
    CheckpointMismatch,
    CheckpointNotFound,
    TeacherUntrained,
    Unavailable,
)

LOGGER = "groupflow.trainer"


@attrs.frozen
class Cached:
    """A cache folder holding the default `count` teacher, and that teacher's training."""

    directory: Path
    trained: _domain_teachers.Trained

    @property
    def entry(self) -> _teacher_cache.CacheEntry:
        key = _domain_teachers.cache_key("count", DEFAULT_RECIPE)
        return _teacher_cache.CacheEntry.of(self.directory, "count", key)


@pytest.fixture(scope="module", autouse=True)
def one_thread() -> Iterator[None]:
    """One torch thread for this module: the models are tiny, and on a shared two-core machine
    a second thread fights the other processes (measured: 4 s for the `count` teacher with one,
    22 s with two). The determinism test also needs the same count as the fixture's training."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.fixture(scope="module")
def trained() -> dict[str, _domain_teachers.Trained]:
    """Both domains trained once, on CPU (timed: printed with `-s`, never asserted)."""
    out = {}
    for domain in DOMAINS:
        started = time.perf_counter()
        out[domain] = train_domain_teacher(domain, device="cpu")
        print(
            f"\n{domain}: held-out accuracy {out[domain].accuracy:.3f} after "
            f"{out[domain].steps} steps, {time.perf_counter() - started:.1f} s "
            f"(torch threads {torch.get_num_threads()})"
        )
    return out


@pytest.fixture(scope="module")
def populated(
    tmp_path_factory: pytest.TempPathFactory, trained: dict[str, _domain_teachers.Trained]
) -> Path:
    directory = tmp_path_factory.mktemp("populated")
    entry = _teacher_cache.CacheEntry.of(
        directory, "count", _domain_teachers.cache_key("count", DEFAULT_RECIPE)
    )
    _teacher_cache.save(entry, trained["count"].teacher, accuracy=trained["count"].accuracy)
    return directory


@pytest.fixture
def cached(tmp_path: Path, populated: Path, trained: dict[str, _domain_teachers.Trained]) -> Cached:
    """A copy of the populated cache, for this test alone."""
    directory = tmp_path / "cache"
    shutil.copytree(populated, directory)
    return Cached(directory, trained["count"])


@attrs.define
class Trainings:
    """Stands in for `train_domain_teacher`: hands back the fixture's training, counting calls
    (a rebuild is a call; a load from the cache is none)."""

    trained: dict[str, _domain_teachers.Trained]
    calls: list[tuple[str, TeacherRecipe]] = attrs.Factory(list)

    def __call__(
        self, domain: str, recipe: TeacherRecipe = DEFAULT_RECIPE, **_: object
    ) -> _domain_teachers.Trained:
        self.calls.append((domain, recipe))
        if recipe == DEFAULT_RECIPE:
            return self.trained[domain]
        return train_domain_teacher(domain, recipe, device="cpu")


@pytest.fixture
def trainings(
    monkeypatch: pytest.MonkeyPatch, trained: dict[str, _domain_teachers.Trained]
) -> Trainings:
    fake = Trainings(trained)
    monkeypatch.setattr(_domain_teachers, "train_domain_teacher", fake)
    return fake


def _same_weights(a: TorchTeacher, b: TorchTeacher) -> bool:
    sa, sb = a.model.state_dict(), b.model.state_dict()
    return sa.keys() == sb.keys() and all(torch.equal(sa[k], sb[k].to(sa[k].device)) for k in sa)


def _warnings(caplog: pytest.LogCaptureFixture) -> list[str]:
    return [r.getMessage() for r in caplog.records if r.name == LOGGER and r.levelname == "WARNING"]


# -- training --------------------------------------------------------------------------------


def test_each_domain_teacher_reaches_the_bar(trained: dict[str, _domain_teachers.Trained]) -> None:
    for domain, result in trained.items():
        assert result.accuracy >= TARGET_ACCURACY, domain
        assert result.teacher.model.cfg == TEACHER_CONFIG
        # measured again, on the held-out prompts and on the prompts a run samples
        assert greedy_accuracy(result.teacher, domain, held_out_prompts(domain)) >= TARGET_ACCURACY
        run_prompts = make_prompts(200, domains=[domain], seed=0)
        assert greedy_accuracy(result.teacher.model, domain, run_prompts) >= TARGET_ACCURACY


def test_training_is_deterministic_and_leaves_the_global_rng_alone(
    trained: dict[str, _domain_teachers.Trained],
) -> None:
    before = torch.random.get_rng_state()
    again = train_domain_teacher("count", device="cpu")
    assert torch.equal(torch.random.get_rng_state(), before)
    assert again.steps == trained["count"].steps
    assert _same_weights(again.teacher, trained["count"].teacher)


def test_a_recipe_that_falls_short_says_so() -> None:
    short = attrs.evolve(DEFAULT_RECIPE, max_steps=2, eval_every=1)
    with pytest.raises(TeacherUntrained, match=r"'reverse' teacher .* after 2 steps, short of"):
        train_domain_teacher("reverse", short, device="cpu")


def test_an_unknown_domain_is_refused(tmp_path: Path) -> None:
    with pytest.raises(ArgumentError, match=r"domain 'sort' is not one of \['count', 'reverse'\]"):
        domain_teacher("sort", cache_dir=tmp_path)


# -- greedy accuracy --------------------------------------------------------------------------


def _oracle(domain: str, *, wrong_at: int | None = None) -> Callable[[Any], Any]:
    """Logits that put all the weight on the right next token (or a wrong one at one answer
    position): a decoder that reads the wrong position, or stops early, scores below 1."""
    task = DOMAINS[domain]

    def logits(ids: Any) -> Any:
        out = torch.zeros((*ids.shape, VOCAB))
        k = ids.shape[1] - PROMPT_LENGTH
        for i, row in enumerate(ids.tolist()):
            answer = task.solve(row[2:PROMPT_LENGTH])
            token = answer[k] if k != wrong_at else (answer[k] + 1) % VOCAB
            out[i, -1, token] = 10.0
        return out

    return logits


def test_greedy_accuracy_takes_any_model_that_gives_logits(
    trained: dict[str, _domain_teachers.Trained],
) -> None:
    prompts = make_prompts(20, domains=["reverse"], seed=3)
    assert greedy_answers(_oracle("reverse"), prompts) == [p.answer for p in prompts]
    assert greedy_accuracy(_oracle("reverse"), "reverse", prompts) == 1.0
    assert greedy_accuracy(_oracle("reverse", wrong_at=ANSWER_LENGTH - 1), "reverse", prompts) == 0
    teacher = trained["reverse"].teacher
    assert greedy_answers(teacher, prompts) == greedy_answers(teacher.model, prompts)


def test_greedy_accuracy_refuses_prompts_of_another_domain_or_none() -> None:
    mixed = make_prompts(4, seed=0)
    with pytest.raises(ArgumentError, match=r"got prompts from \['reverse'\]"):
        greedy_accuracy(_oracle("count"), "count", mixed)
    with pytest.raises(ArgumentError, match="no prompts"):
        greedy_accuracy(_oracle("count"), "count", [])


# -- the cache ---------------------------------------------------------------------------------


def test_the_cache_folder_follows_the_environment(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    monkeypatch.delenv("GROUPFLOW_CACHE", raising=False)
    monkeypatch.delenv("XDG_CACHE_HOME", raising=False)
    assert default_cache_dir() == tmp_path / "home" / ".cache" / "groupflow"
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    assert default_cache_dir() == tmp_path / "xdg" / "groupflow"
    monkeypatch.setenv("GROUPFLOW_CACHE", str(tmp_path / "mine"))
    assert default_cache_dir() == tmp_path / "mine"
    monkeypatch.setenv("GROUPFLOW_CACHE", "")
    assert default_cache_dir() == tmp_path / "xdg" / "groupflow"


def test_a_first_call_trains_and_caches_where_the_environment_says(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, trainings: Trainings
) -> None:
    monkeypatch.setenv("GROUPFLOW_CACHE", str(tmp_path / "env-cache"))
    said: list[str] = []
    teacher = domain_teacher("count", device="cpu", on_progress=said.append)
    assert trainings.calls == [("count", DEFAULT_RECIPE)]
    assert _same_weights(teacher, trainings.trained["count"].teacher)
    files = sorted(p.name for p in (tmp_path / "env-cache").iterdir())
    assert len(files) == 2 and files[0].startswith("teacher-count-")
    assert {Path(f).suffix for f in files} == {".json", ".pt"}
    assert "cached at" in said[-1]


def check_the_cache_is_reused(
    cached: Cached, trainings: Trainings, caplog: pytest.LogCaptureFixture
) -> None:
    said: list[str] = []
    teacher = domain_teacher(
        "count", cache_dir=cached.directory, device="cpu", on_progress=said.append
    )
    assert trainings.calls == [], "a second call trained again instead of loading the cache"
    assert _same_weights(teacher, cached.trained.teacher)
    assert greedy_accuracy(teacher, "count", held_out_prompts("count")) >= TARGET_ACCURACY
    assert _warnings(caplog) == []
    assert said and "loaded" in said[-1]


def test_the_cache_is_reused(
    cached: Cached, trainings: Trainings, caplog: pytest.LogCaptureFixture
) -> None:
    check_the_cache_is_reused(cached, trainings, caplog)


SMALLER = attrs.evolve(DEFAULT_RECIPE, config=attrs.evolve(TEACHER_CONFIG, d_model=32))


def check_recipes_live_side_by_side(
    cached: Cached, trainings: Trainings, caplog: pytest.LogCaptureFixture
) -> None:
    """A teacher of another shape gets a file of its own: neither overwrites the other."""
    small = domain_teacher("count", cache_dir=cached.directory, device="cpu", recipe=SMALLER)
    assert small.model.cfg == SMALLER.config
    assert _warnings(caplog) == [], "a teacher of another shape was found under this one's name"
    assert len(list(cached.directory.glob("teacher-count-*.pt"))) == 2
    default = domain_teacher("count", cache_dir=cached.directory, device="cpu")
    assert default.model.cfg == TEACHER_CONFIG
    assert trainings.calls == [("count", SMALLER)]


def test_recipes_live_side_by_side(
    cached: Cached, trainings: Trainings, caplog: pytest.LogCaptureFixture
) -> None:
    check_recipes_live_side_by_side(cached, trainings, caplog)


def _flip_a_weight(entry: _teacher_cache.CacheEntry) -> None:
    data = bytearray(entry.weights.read_bytes())
    data[len(data) // 2] ^= 0xFF  # inside a tensor's bytes: torch.load takes it without a word
    entry.weights.write_bytes(bytes(data))


def _truncate(entry: _teacher_cache.CacheEntry) -> None:
    entry.weights.write_bytes(entry.weights.read_bytes()[:1000])


def _garble_manifest(entry: _teacher_cache.CacheEntry) -> None:
    entry.manifest.write_text("{not json")


def _drop_manifest(entry: _teacher_cache.CacheEntry) -> None:
    entry.manifest.unlink()


def _unloadable_but_vouched_for(entry: _teacher_cache.CacheEntry) -> None:
    """Bytes that pass the checksum (the manifest is rewritten for them) but are no teacher."""
    _rewrite(entry, b"not a torch file")


def _rewrite(entry: _teacher_cache.CacheEntry, data: bytes) -> None:
    import json

    entry.weights.write_bytes(data)
    manifest = json.loads(entry.manifest.read_text())
    manifest.update(sha256=_teacher_cache.digest(data), bytes=len(data))
    manifest["checksum"] = _teacher_cache._manifest_checksum(manifest)
    entry.manifest.write_text(json.dumps(manifest))


DAMAGE = {
    "a flipped weight": _flip_a_weight,
    "truncated weights": _truncate,
    "a garbled manifest": _garble_manifest,
    "weights without a manifest": _drop_manifest,
    "unloadable weights": _unloadable_but_vouched_for,
}


def check_a_damaged_file_is_rebuilt(
    cached: Cached, trainings: Trainings, caplog: pytest.LogCaptureFixture, damage: str
) -> None:
    entry = cached.entry
    DAMAGE[damage](entry)
    with pytest.raises(CheckpointCorrupt, match=str(cached.directory)):
        _teacher_cache.load(entry, config=TEACHER_CONFIG, device="cpu")
    teacher = domain_teacher("count", cache_dir=cached.directory, device="cpu")
    assert trainings.calls == [("count", DEFAULT_RECIPE)], f"{damage} was not rebuilt"
    assert _same_weights(teacher, cached.trained.teacher)
    warnings = _warnings(caplog)
    assert len(warnings) == 1, f"{damage}: warned {warnings}"
    assert str(entry.weights) in warnings[0] and "rebuilding" in warnings[0]
    _teacher_cache.load(entry, config=TEACHER_CONFIG, device="cpu")  # sound again


@pytest.mark.parametrize("damage", sorted(DAMAGE))
def test_a_damaged_file_is_rebuilt_with_a_warning(
    cached: Cached, trainings: Trainings, caplog: pytest.LogCaptureFixture, damage: str
) -> None:
    check_a_damaged_file_is_rebuilt(cached, trainings, caplog, damage)


def _another_seeds_teacher(entry: _teacher_cache.CacheEntry) -> None:
    """The files of a teacher trained from another seed, copied under this key's names."""
    other = attrs.evolve(DEFAULT_RECIPE, seed=1)
    elsewhere = entry.weights.parent / "elsewhere"
    source = _teacher_cache.CacheEntry.of(
        elsewhere, "count", _domain_teachers.cache_key("count", other)
    )
    random = TorchTeacher.from_config(TEACHER_CONFIG, seed=1, device="cpu")
    _teacher_cache.save(source, random, accuracy=0.0)
    shutil.copyfile(source.weights, entry.weights)
    shutil.copyfile(source.manifest, entry.manifest)
    shutil.rmtree(elsewhere)


def _another_shape_under_this_key(entry: _teacher_cache.CacheEntry) -> None:
    """A manifest for this key vouching for a model of another shape."""
    random = TorchTeacher.from_config(attrs.evolve(TEACHER_CONFIG, d_model=32), device="cpu")
    _teacher_cache.save(entry, random, accuracy=0.0)


MISMATCH = {
    "another seed's teacher": _another_seeds_teacher,
    "another shape under this key": _another_shape_under_this_key,
}


def check_a_mismatched_file_is_rebuilt(
    cached: Cached, trainings: Trainings, caplog: pytest.LogCaptureFixture, mismatch: str
) -> None:
    entry = cached.entry
    MISMATCH[mismatch](entry)
    with pytest.raises(CheckpointMismatch, match=str(cached.directory)):
        _teacher_cache.load(entry, config=TEACHER_CONFIG, device="cpu")
    teacher = domain_teacher("count", cache_dir=cached.directory, device="cpu")
    assert trainings.calls == [("count", DEFAULT_RECIPE)], f"{mismatch} was used as it was"
    assert _same_weights(teacher, cached.trained.teacher)
    warnings = _warnings(caplog)
    assert len(warnings) == 1, f"{mismatch}: warned {warnings}"
    assert str(entry.weights) in warnings[0] and "rebuilding" in warnings[0]


@pytest.mark.parametrize("mismatch", sorted(MISMATCH))
def test_a_mismatched_file_is_rebuilt_with_a_warning(
    cached: Cached, trainings: Trainings, caplog: pytest.LogCaptureFixture, mismatch: str
) -> None:
    check_a_mismatched_file_is_rebuilt(cached, trainings, caplog, mismatch)


class Crash(Exception):
    """The process dies here."""


def _crash_inside_torch_save(monkeypatch: pytest.MonkeyPatch) -> None:
    real = TorchTeacher.save

    def half_then_die(self: TorchTeacher, path: Path) -> None:
        real(self, path)
        Path(path).write_bytes(Path(path).read_bytes()[:500])
        raise Crash

    monkeypatch.setattr(TorchTeacher, "save", half_then_die)


def _crash_between_renames(monkeypatch: pytest.MonkeyPatch) -> None:
    import os

    real = os.replace
    seen: list[object] = []

    def replace_once(src: object, dst: object) -> None:
        if seen:
            raise Crash
        seen.append(dst)
        real(src, dst)  # type: ignore[arg-type]

    monkeypatch.setattr(os, "replace", replace_once)


CRASHES = {
    "inside torch.save": _crash_inside_torch_save,
    "between the renames": _crash_between_renames,
}


def check_a_crash_during_save_leaves_no_valid_looking_file(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, trainings: Trainings, crash: str
) -> None:
    directory = tmp_path / "crashed"
    entry = _teacher_cache.CacheEntry.of(
        directory, "count", _domain_teachers.cache_key("count", DEFAULT_RECIPE)
    )
    with monkeypatch.context() as patch:
        CRASHES[crash](patch)
        with pytest.raises(Crash):
            domain_teacher("count", cache_dir=directory, device="cpu")
    left = sorted(p.name for p in directory.iterdir())
    assert not any(name.endswith(".tmp") for name in left), left
    if crash == "inside torch.save":
        assert left == [], f"a crash inside torch.save left {left}"
    with pytest.raises((CheckpointNotFound, CheckpointCorrupt)):
        _teacher_cache.load(entry, config=TEACHER_CONFIG, device="cpu")
    domain_teacher("count", cache_dir=directory, device="cpu")  # rebuilt, then sound
    _teacher_cache.load(entry, config=TEACHER_CONFIG, device="cpu")


@pytest.mark.parametrize("crash", sorted(CRASHES))
def test_a_crash_during_save_leaves_no_valid_looking_file(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, trainings: Trainings, crash: str
) -> None:
    check_a_crash_during_save_leaves_no_valid_looking_file(tmp_path, monkeypatch, trainings, crash)


# -- --teacher DOMAIN=PATH ------------------------------------------------------------------------


def test_overrides_parse(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.setenv("HOME", str(tmp_path))
    assert parse_teacher_override("count=/models/count.pt") == ("count", Path("/models/count.pt"))
    assert parse_teacher_override(" reverse = ~/r ") == ("reverse", tmp_path / "r")
    assert parse_teacher_override("count=a=b") == ("count", Path("a=b"))


BAD_OVERRIDES = {
    "count": "expected DOMAIN=PATH",
    "sort=x.pt": "unknown domain 'sort'",
    "=x.pt": "unknown domain ''",
    "count=": "no path after '='",
    "count=  ": "no path after '='",
}


def check_overrides_refuse_bad_text() -> None:
    for text, reason in BAD_OVERRIDES.items():
        with pytest.raises(ArgumentError) as info:
            parse_teacher_override(text)
        message = str(info.value)
        assert repr(text) in message and reason in message and "\n" not in message, message


def test_overrides_refuse_bad_text() -> None:
    check_overrides_refuse_bad_text()


def test_a_torch_override_file_loads(
    tmp_path: Path, trained: dict[str, _domain_teachers.Trained]
) -> None:
    path = tmp_path / "count.pt"
    trained["count"].teacher.save(path)
    teacher = teacher_from_path(str(path), device="cpu")
    assert isinstance(teacher, TorchTeacher)
    assert _same_weights(teacher, trained["count"].teacher)
    assert greedy_accuracy(teacher, "count", held_out_prompts("count")) >= TARGET_ACCURACY


def _saved(tmp_path: Path, cfg: LMConfig) -> Path:
    path = tmp_path / "teacher.pt"
    TorchTeacher.from_config(cfg, device="cpu").save(path)
    return path


def check_a_mismatched_torch_override_is_refused(tmp_path: Path) -> None:
    small_vocab = _saved(tmp_path, attrs.evolve(TEACHER_CONFIG, vocab_size=VOCAB - 1))
    with pytest.raises(CheckpointMismatch, match=f"{small_vocab} has a vocabulary of 31"):
        teacher_from_path(small_vocab, device="cpu")
    short = _saved(tmp_path, attrs.evolve(TEACHER_CONFIG, max_len=PROMPT_LENGTH))
    with pytest.raises(CheckpointMismatch, match=f"{short} holds 6 tokens at most"):
        teacher_from_path(short, device="cpu")


def test_a_mismatched_torch_override_is_refused(tmp_path: Path) -> None:
    check_a_mismatched_torch_override_is_refused(tmp_path)
    bigger = _saved(tmp_path, attrs.evolve(TEACHER_CONFIG, vocab_size=64, max_len=16))
    loaded = teacher_from_path(bigger, device="cpu")
    assert isinstance(loaded, TorchTeacher) and loaded.model.cfg.vocab_size == 64  # covers it


def test_an_override_that_is_no_teacher_is_refused(tmp_path: Path) -> None:
    junk = tmp_path / "junk.pt"
    junk.write_bytes(b"not a torch file")
    with pytest.raises(CheckpointCorrupt, match=f"teacher {junk} is not a file of torch") as info:
        teacher_from_path(junk, device="cpu")
    assert "\n" not in str(info.value) and "weights_only" not in str(info.value)
    with pytest.raises(CheckpointNotFound, match="no such file or folder"):
        teacher_from_path(tmp_path / "absent.pt", device="cpu")
    with pytest.raises(CheckpointNotFound, match="without config.json"):
        teacher_from_path(tmp_path, device="cpu")


def _hf_folder(tmp_path: Path, *, vocab: int) -> Path:
    transformers = pytest.importorskip(
        "transformers", reason="transformers not installed: pip install 'groupflow[hf]'"
    )
    config = transformers.LlamaConfig(
        vocab_size=vocab,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=64,
        bos_token_id=0,
        eos_token_id=0,
        pad_token_id=0,
    )
    folder = tmp_path / f"hf-{vocab}"
    torch.manual_seed(0)
    transformers.AutoModelForCausalLM.from_config(config).save_pretrained(folder)
    return folder


@pytest.fixture
def offline(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("HF_HUB_DISABLE_PROGRESS_BARS", "1")


@pytest.mark.usefixtures("offline")
def test_an_hf_override_folder_loads(tmp_path: Path) -> None:
    from groupflow.impl._teachers._hf import HFTeacher
    from groupflow.impl.contract import TokenRow

    folder = _hf_folder(tmp_path, vocab=VOCAB)
    teacher = teacher_from_path(folder, device="cpu")
    assert isinstance(teacher, HFTeacher)
    prompt = make_prompts(1, domains=["count"])[0]
    row = TokenRow((*prompt.tokens, *prompt.answer), PROMPT_LENGTH)
    ((values,),) = teacher.score_shards([[row]])
    assert len(values) == ANSWER_LENGTH
    assert 0.0 <= greedy_accuracy(teacher, "count", [prompt]) <= 1.0


@pytest.mark.usefixtures("offline")
def test_an_hf_override_with_too_small_a_vocabulary_is_refused(tmp_path: Path) -> None:
    folder = _hf_folder(tmp_path, vocab=16)
    with pytest.raises(CheckpointMismatch, match=f"teacher {folder} has a vocabulary of 16"):
        teacher_from_path(folder, device="cpu")


def test_an_hf_override_without_transformers_says_how_to_install_it(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    folder = tmp_path / "hf"
    folder.mkdir()
    (folder / "config.json").write_text("{}")
    monkeypatch.setitem(sys.modules, "transformers", None)  # import transformers fails
    with pytest.raises(Unavailable, match=r"pip install 'groupflow\[hf\]'"):
        teacher_from_path(folder, device="cpu")


# -- seeded bugs: each small change of behaviour fails a check above ------------------------------


def _key_ignoring_the_config(
    domain: str, recipe: TeacherRecipe = DEFAULT_RECIPE
) -> dict[str, object]:
    return _REAL_KEY(domain, attrs.evolve(recipe, config=TEACHER_CONFIG))


_REAL_KEY = _domain_teachers.cache_key


def _loader_that_never_finds(entry: object, **_: object) -> object:
    raise CheckpointNotFound("never cached")


def _writes_straight_into_place(final: Path, temporaries: list[Path]) -> Path:
    return final


SEEDED_BUGS: dict[str, tuple[Callable[[pytest.MonkeyPatch], None], str]] = {
    "the cache key ignores the LMConfig": (
        lambda m: m.setattr(_domain_teachers, "cache_key", _key_ignoring_the_config),
        "side_by_side",
    ),
    "the loader skips the checksum": (
        lambda m: m.setattr(_teacher_cache, "_verify_weights", lambda *a: None),
        "damaged:a flipped weight",
    ),
    "the loader skips the key comparison": (
        lambda m: m.setattr(_teacher_cache, "_verify_key", lambda *a: None),
        "mismatched:another seed's teacher",
    ),
    "the loader skips the config check": (
        lambda m: m.setattr(_teacher_cache, "_verify_config", lambda *a: None),
        "mismatched:another shape under this key",
    ),
    "the cache is never read": (
        lambda m: m.setattr(_teacher_cache, "load", _loader_that_never_finds),
        "reused",
    ),
    "a rebuild without a warning": (
        lambda m: m.setattr(_domain_teachers.log, "warning", lambda *a: None),
        "damaged:truncated weights",
    ),
    "the save writes straight into place": (
        lambda m: m.setattr(_teacher_cache, "_temporary", _writes_straight_into_place),
        "crash:inside torch.save",
    ),
    "an override of any domain is accepted": (
        lambda m: m.setattr(_teacher_override, "DOMAINS", {**DOMAINS, "sort": DOMAINS["count"]}),
        "bad overrides",
    ),
    "an override is not checked against the task": (
        lambda m: m.setattr(_teacher_override, "_check_fits", lambda *a, **k: None),
        "mismatched override",
    ),
}


@pytest.fixture
def check(
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    caplog: pytest.LogCaptureFixture,
    cached: Cached,
    trainings: Trainings,
) -> Callable[[str], None]:
    """Runs a named check (its fixtures are made before any bug is seeded)."""

    def run(name: str) -> None:
        kind, _, case = name.partition(":")
        if kind == "bad overrides":
            check_overrides_refuse_bad_text()
        elif kind == "mismatched override":
            check_a_mismatched_torch_override_is_refused(tmp_path)
        elif kind == "crash":
            check_a_crash_during_save_leaves_no_valid_looking_file(
                tmp_path, monkeypatch, trainings, case
            )
        elif kind == "reused":
            check_the_cache_is_reused(cached, trainings, caplog)
        elif kind == "side_by_side":
            check_recipes_live_side_by_side(cached, trainings, caplog)
        elif kind == "damaged":
            check_a_damaged_file_is_rebuilt(cached, trainings, caplog, case)
        elif kind == "mismatched":
            check_a_mismatched_file_is_rebuilt(cached, trainings, caplog, case)
        else:
            raise LookupError(f"no check {name!r}")

    caplog.set_level(logging.WARNING, logger=LOGGER)
    return run


@pytest.mark.parametrize("bug", sorted(SEEDED_BUGS))
def test_a_seeded_bug_is_caught(
    bug: str, check: Callable[[str], None], monkeypatch: pytest.MonkeyPatch
) -> None:
    seed, name = SEEDED_BUGS[bug]
    seed(monkeypatch)
    with pytest.raises((AssertionError, pytest.fail.Exception)):
        check(name)
